"""The API key: one rule for every HTTP route of `afd serve` and `afd router`.

With keys set, every route requires `Authorization: Bearer <key>` but those on OPEN_PATHS (health
for load balancers and orchestrators, the API's own description) and `/metrics` unless
`--metrics-require-key` (Prometheus scrapers usually hold no key; vLLM leaves it open too). The
rule names what stays open, not what is guarded, so a route added later is guarded from the start
(tests/server/test_auth.py enumerates the app's routes). Unknown paths answer 401 too: without the
key nobody learns which paths exist.

Keys come from `--api-key` (several times, for rotation), `--api-key-file` (one key per line) and
the `AFD_API_KEY` environment variable (one key, or several one per line; how `afd serve --pd`
hands its keys to its instances), the last two keeping the key out of `ps`. A presented key
is compared with every configured one in constant time (`hmac.compare_digest`), and no log line or
error message ever holds a key.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from afd_engine.errors import ConfigError

ENV_KEY = "AFD_API_KEY"
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
METRICS_PATH = "/metrics"


def resolve_keys(api_key: str | Iterable[str] | None, api_key_file: str | None, environ=os.environ) -> tuple[str, ...]:
    """Every configured key: the flag's (one or several), the file's lines, the environment's."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if api_key_file:
        path = Path(api_key_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file={api_key_file}: cannot read it ({exc.strerror})") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ConfigError(f"--api-key-file={api_key_file}: holds no key (one per line)")
        keys += from_file
    keys += [line.strip() for line in environ.get(ENV_KEY, "").splitlines() if line.strip()]  # one per line
    if any(not k or k != k.strip() for k in keys):
        raise ConfigError("an API key is empty or starts or ends with whitespace")
    return tuple(dict.fromkeys(keys))


def tls_settings(keyfile: str | None, certfile: str | None, ca_certs: str | None) -> dict:
    """uvicorn's TLS settings from --ssl-keyfile / --ssl-certfile / --ssl-ca-certs (empty: plain
    HTTP); --ssl-ca-certs requires client certificates from those CAs (mutual TLS)."""
    if bool(keyfile) != bool(certfile):
        raise ConfigError("--ssl-keyfile and --ssl-certfile go together (the key and its certificate)")
    if ca_certs and not certfile:
        raise ConfigError("--ssl-ca-certs checks client certificates over HTTPS: give --ssl-keyfile and --ssl-certfile")
    for flag, path in (("--ssl-keyfile", keyfile), ("--ssl-certfile", certfile), ("--ssl-ca-certs", ca_certs)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag}={path}: no such file")
    if not certfile:
        return {}
    import ssl

    required = ssl.CERT_REQUIRED if ca_certs else ssl.CERT_NONE
    return dict(ssl_keyfile=keyfile, ssl_certfile=certfile, ssl_ca_certs=ca_certs, ssl_cert_reqs=required)


def needs_key(path: str, metrics_require_key: bool = False) -> bool:
    """Whether a request for `path` must carry a key (when keys are set)."""
    if path == METRICS_PATH:
        return metrics_require_key
    return path not in OPEN_PATHS


def key_matches(authorization: str | None, keys: tuple[str, ...]) -> bool:
    """Whether an Authorization header holds one of `keys`: each compared in constant time, all of
    them every time (no early exit tells which one came close)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        token = ""
    given = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched


def install_auth(app, keys: tuple[str, ...], metrics_require_key: bool, reject) -> None:
    """Adds the key check to a FastAPI `app` as its outermost middleware (call it after every other
    `add_middleware`, so no body is read for a request without the key); `reject()` is the 401."""
    if not keys:
        return

    @app.middleware("http")
    async def check_key(request, call_next):
        if needs_key(request.url.path, metrics_require_key) and not key_matches(
            request.headers.get("authorization"), keys
        ):
            return reject()
        return await call_next(request)
