"""The messages between prefill and decode ranks (ZeroMQ multipart: a msgpack header, then for
the builtin backend's pages one raw frame), and the description two instances must share."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgpack

# header kinds
DEST = "dest"  # decode -> prefill: where the request's pages go (and who the decode rank is)
PAGES = "pages"  # prefill -> decode (builtin backend): page contents for some destination pages
DONE = "done"  # prefill -> decode: the prompt's pages are all sent; the first token and state
FAIL = "fail"  # either way: the request failed on the sender's side (reason inside)


KINDS = (DEST, PAGES, DONE, FAIL)


def well_formed(header) -> bool:
    """A header this side can act on: a dict of a known kind naming a room (what a message's
    fields hold beyond that is checked where it is used)."""
    return (
        isinstance(header, dict)
        and header.get("kind") in KINDS
        and isinstance(header.get("room"), int)
        and not isinstance(header.get("room"), bool)
    )


def pack(header: dict) -> bytes:
    return msgpack.packb(header)


def unpack(frame) -> dict:
    return msgpack.unpackb(frame)


def instance_description(config, model_path, page_size: int, kv_dtype, kv_layers: int | None = None) -> dict:
    """What a prefill and a decode instance must agree on for pages to mean the same thing.
    `kv_layers`: the KV cache's layers (with speculative decoding, the MTP module's one more)."""
    return {
        "model": _model_fingerprint(Path(model_path)),
        "architecture": config.architecture,
        "num_layers": config.num_layers if kv_layers is None else kv_layers,
        "kv_cache_dim": config.kv_cache_dim,
        "page_size": page_size,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
    }


_NAMES = {
    "model": "model (config.json or weight files differ)",
    "architecture": "architecture",
    "num_layers": "KV cache layers (speculative decoding adds the MTP module's: give both instances the same "
    "--speculative-algorithm)",
    "kv_cache_dim": "KV cache row size (with sparse attention, --index-cache-dtype changes it)",
    "page_size": "page size",
    "kv_dtype": "KV cache dtype",
}


def mismatch(prefill: dict, decode: dict) -> str | None:
    """One line naming every difference between the two descriptions, or None."""
    diffs = [
        f"{_NAMES[k]}: prefill {prefill.get(k)!r}, decode {decode.get(k)!r}"
        for k in _NAMES
        if prefill.get(k) != decode.get(k)
    ]
    if not diffs:
        return None
    return "the prefill and decode instances do not match: " + "; ".join(diffs)


def _model_fingerprint(path: Path) -> str:
    """config.json's bytes and the weight files' names and sizes (reading the weights would take
    minutes on a large checkpoint)."""
    h = hashlib.sha256()
    config = path / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]
