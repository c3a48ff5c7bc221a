"""The checkpoint's tokenizer, loaded by transformers without running any code from the checkpoint.

Some checkpoints ship their tokenizer as Python: Kimi-K2's `tokenization_kimi.py` (tiktoken-based),
named by `auto_map` in `tokenizer_config.json`, with no `tokenizer.json`. transformers runs such code
only with `trust_remote_code`, which the engine never passes (it would execute files from the model
directory); without it transformers raises a multi-line error, or on a terminal asks whether to run
the code and waits for an answer. `check_tokenizer` refuses such a checkpoint in one line naming the
file, before any weight is read. A checkpoint that carries such a file but declares a tokenizer
class transformers provides needs no remote code and is not refused.

`load_tokenizer` also keeps transformers from reading the model's remote code: AutoTokenizer first
loads `config.json`, and Kimi-K2's names `model_type: kimi_k2`, which transformers knows only through
the `auto_map` to the checkpoint's own configuration code. The engine serves that checkpoint as
DeepSeek-V3, so the tokenizer is given DeepSeek-V3's configuration instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from afd_engine.errors import ModelLoadError
from afd_engine.hf_config import SERVED, architecture_of

TOKENIZER_CONFIG = "tokenizer_config.json"
FAST_TOKENIZER = "tokenizer.json"


def check_tokenizer(model_path: str | Path) -> None:
    """A ModelLoadError naming the Python file when the checkpoint's tokenizer needs remote code."""
    path = Path(model_path)
    settings = _json(path / TOKENIZER_CONFIG)
    if _provided_by_transformers(settings.get("tokenizer_class")):
        return
    auto_map = settings.get("auto_map") or {}
    code = _module_file(auto_map.get("AutoTokenizer")) if isinstance(auto_map, dict) else None
    if code is None and not (path / FAST_TOKENIZER).is_file():
        code = next((f.name for f in sorted(path.glob("tokenization_*.py"))), None)
    if code is not None:
        raise ModelLoadError(
            f"the tokenizer of {str(path)!r} needs remote code ({code}), which the engine does not run; "
            f"give the checkpoint a {FAST_TOKENIZER} and tokenizer_class PreTrainedTokenizerFast in {TOKENIZER_CONFIG}"
        )


def load_tokenizer(model_path: str | Path):
    """transformers' tokenizer of the checkpoint; a one-line ModelLoadError when there is none."""
    from transformers import AutoTokenizer

    check_tokenizer(model_path)
    try:
        return AutoTokenizer.from_pretrained(str(model_path), **_served_config(Path(model_path)))
    except Exception as exc:  # transformers raises many kinds; all mean "no usable tokenizer"
        raise ModelLoadError(f"cannot load the tokenizer from {str(model_path)!r}: {exc}") from exc


def _served_config(path: Path) -> dict:
    """{"config": ...} for a checkpoint whose model_type transformers does not know (Kimi-K2's
    kimi_k2): the configuration of the architecture the engine serves it as. Nothing otherwise."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = _json(path / "config.json")
    if raw.get("model_type") in CONFIG_MAPPING:
        return {}
    arch = architecture_of(raw)
    model_type = next((t for t, a in SERVED.items() if a == arch and t in CONFIG_MAPPING), None)
    return {"config": AutoConfig.for_model(model_type)} if model_type else {}


def _json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        settings = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file} is not valid JSON: {exc}") from None
    return settings if isinstance(settings, dict) else {}


def _provided_by_transformers(tokenizer_class) -> bool:
    if not isinstance(tokenizer_class, str):
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    return tokenizer_class_from_name(tokenizer_class) is not None


def _module_file(entry) -> str | None:
    """`tokenization_kimi.py` from an auto_map entry: "tokenization_kimi.TikTokenTokenizer", a
    [slow, fast] pair of such names (either may be null), or either with a "repo--" prefix."""
    names = entry if isinstance(entry, list) else [entry]
    for name in names:
        if isinstance(name, str) and "." in name:
            return name.split("--")[-1].rsplit(".", 1)[0] + ".py"
    return None
