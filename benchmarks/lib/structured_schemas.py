"""Twenty JSON schemas of the shapes clients send (nested objects, arrays, enums, bounded numbers,
required and optional fields), and five tools, for bench_structured.py and the structured-output
tests."""

from __future__ import annotations

_NAME = {"type": "string", "maxLength": 24}
_AGE = {"type": "integer", "minimum": 0, "maximum": 150}

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": _NAME, "age": _AGE}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}, "label": _NAME},
        "required": ["score", "label"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {"id": _AGE, "name": _NAME}, "required": ["id", "name"]},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["points"],
    },
    {
        "type": "object",
        "properties": {"title": _NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["title", "year"],
    },
    {
        "type": "object",
        "properties": {"level": {"enum": ["low", "medium", "high"]}, "note": _NAME},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": 0, "maximum": 9},
            "y": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["x", "y"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"sku": _NAME, "qty": _AGE}, "required": ["sku", "qty"]},
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["answer", "confidence"],
    },
    {
        "type": "object",
        "properties": {"city": _NAME, "country": {"type": "string", "minLength": 2, "maxLength": 2}},
        "required": ["city", "country"],
    },
    {
        "type": "object",
        "properties": {
            "meta": {
                "type": "object",
                "properties": {
                    "version": {"type": "integer", "minimum": 1, "maximum": 99},
                    "stable": {"type": "boolean"},
                },
                "required": ["version", "stable"],
            }
        },
        "required": ["meta"],
    },
    {"type": "object", "properties": {"ids": {"type": "array", "items": _AGE, "maxItems": 5}}, "required": ["ids"]},
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["queued", "running", "done", "failed"]},
            "retries": {"type": "integer", "minimum": 0, "maximum": 5},
        },
        "required": ["status", "retries"],
    },
    {"type": "object", "properties": {"first": _NAME, "last": _NAME, "email": _NAME}, "required": ["first", "last"]},
    {
        "type": "object",
        "properties": {
            "lat": {"type": "number", "minimum": -90, "maximum": 90},
            "lon": {"type": "number", "minimum": -180, "maximum": 180},
        },
        "required": ["lat", "lon"],
    },
    {
        "type": "object",
        "properties": {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        },
        "required": ["matrix"],
    },
    {
        "type": "object",
        "properties": {"kind": {"const": "event"}, "name": _NAME, "priority": {"enum": [1, 2, 3]}},
        "required": ["kind", "name", "priority"],
    },
]

TOOLS: list[dict] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
                },
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documentation",
            "parameters": {
                "type": "object",
                "properties": {"query": _NAME, "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "description": "Set an alarm",
            "parameters": {
                "type": "object",
                "properties": {
                    "hour": {"type": "integer", "minimum": 0, "maximum": 23},
                    "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                },
                "required": ["hour", "minute"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "lookup_user",
            "description": "Find a user by id",
            "parameters": {
                "type": "object",
                "properties": {
                    "user_id": _AGE,
                    "fields": {"type": "array", "items": {"enum": ["name", "email", "age"]}, "maxItems": 3},
                },
                "required": ["user_id"],
            },
        },
    },
]

# bench_structured.py's overhead part: long enough that 32 constrained requests all decode for the
# whole timed window (at least 12 records of about 10 tokens each).
LONG_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tag": {"enum": ["alpha", "beta", "gamma", "delta"]},
                },
                "required": ["id", "tag"],
            },
            "minItems": 12,
            "maxItems": 16,
        }
    },
    "required": ["records"],
}

PROMPTS = ["Describe the json module", "a record", "What is a tuple?", "Give me data", "pathlib", "x"]


def ask_schema(client, i: int):
    """Request i through an OpenAI client: schema i mod 20, greedy or sampled by parity. Returns
    (the schema, the chat completion)."""
    schema = SCHEMAS[i % len(SCHEMAS)]
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{i % 20}", "schema": schema}},
        max_tokens=200,
        temperature=0.0 if i % 2 == 0 else 1.0,
        seed=i,
    )
    return schema, out


def ask_tool_call(client, i: int, stream: bool = False, parallel: bool = False):
    """Request i with all five tools and a call required. With parallel calls the tiny model tends
    to go on calling until max_tokens (a deepseekv3 call costs it some 60 tokens of markers)."""
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=220,
        temperature=1.0,
        seed=i,
        stream=stream,
    )
