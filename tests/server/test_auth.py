"""The API key (afd_engine/server/auth.py): one rule for every route of `afd serve` and `afd router`,
keys from flags, a file and the environment, compared in constant time, never printed."""

from __future__ import annotations

import asyncio
import ssl

import httpx
import openai
import pytest
from fastapi.routing import APIRoute
from starlette.routing import Route

from afd_engine.errors import ConfigError
from afd_engine.server import auth
from afd_engine.server.api_server import build_app
from afd_engine.server.pd_router import PDRouter, build_router_app
from afd_engine.server.serve import ServerArgs
from tests.server.conftest import serve_args

KEY, OTHER = "k-1234-sesame", "k-5678-rotated"
# what may answer without a key; everything else, and any route added later, must not
OPEN = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


def routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route of the app, path parameters filled in."""
    out = []
    for r in app.routes:
        if isinstance(r, (APIRoute, Route)):
            path = r.path.replace("{", "").replace("}", "")
            out += [(m, path) for m in sorted(r.methods or {"GET"}) if m != "HEAD"]
    return out


def statuses(app, requests, key: str | None) -> dict[tuple[str, str], int]:
    """Status of each (method, path) in process (no lifespan: no engine behind it)."""

    async def run():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return {(m, p): (await client.request(m, p, headers=headers, json={})).status_code for m, p in requests}

    return asyncio.run(run())


def check_every_route_is_guarded(app, metrics_open: bool) -> None:
    found = routes(app)
    assert ("POST", "/v1/chat/completions") in found and ("GET", "/health") in found
    open_paths = OPEN | ({"/metrics"} if metrics_open else set())
    probes = found + [("POST", "/no/such/route")]
    without = statuses(app, probes, None)
    wrong = statuses(app, probes, OTHER)
    for probe in probes:
        if probe[1] in open_paths:
            assert without[probe] != 401, probe
        else:  # guarded: 401 without a key and with a wrong one
            assert without[probe] == wrong[probe] == 401, probe
    right = statuses(app, probes, KEY)
    assert all(status != 401 for status in right.values()), right


@pytest.fixture(scope="module")
def server_app(tiny_v3):
    def app(**flags):
        args = ServerArgs(api_key=[KEY], **flags)
        return build_app(tiny_v3, "tiny", args, lambda: {}, None, None)

    return app


def test_every_route_of_the_server_needs_the_key_but_the_open_ones(server_app):
    """Seen red: with the old rule (/v1/* and /expert_load only), POST /generate answered without
    the key, and so did /server_info."""
    check_every_route_is_guarded(server_app(), metrics_open=True)
    routes_ = {p for _, p in routes(server_app())}
    assert {"/generate", "/expert_load", "/server_info", "/v1/models"} <= routes_


def test_metrics_can_require_the_key(server_app):
    check_every_route_is_guarded(server_app(metrics_require_key=True), metrics_open=False)


def test_every_route_of_the_router_needs_the_key_but_the_open_ones():
    router = PDRouter(["http://127.0.0.1:9"], ["http://127.0.0.1:9"], keys=(KEY,))
    assert router.own_headers == {"Authorization": f"Bearer {KEY}"}  # what it presents to instances
    check_every_route_is_guarded(build_router_app(router, (KEY,)), metrics_open=True)


def test_keys_from_flags_file_and_environment(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# rotated monthly\n{OTHER}\n\n  third-key  \n")
    env = {auth.ENV_KEY: "env-key"}
    assert auth.resolve_keys([KEY], str(keys_file), env) == (KEY, OTHER, "third-key", "env-key")
    assert auth.resolve_keys(KEY, None, {}) == (KEY,)  # the Python API's single string
    assert auth.resolve_keys(None, None, {}) == ()  # no key: everything open
    assert auth.resolve_keys([KEY, KEY], None, {auth.ENV_KEY: KEY}) == (KEY,)
    with pytest.raises(ConfigError, match="--api-key-file=.*/missing: cannot read it"):
        auth.resolve_keys(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        auth.resolve_keys(None, str(tmp_path / "empty"), {})
    with pytest.raises(ConfigError, match="empty or starts or ends with whitespace"):
        auth.resolve_keys([" padded"], None, {})
    with pytest.raises(ConfigError, match="--api-key-file=.*: cannot read it"):
        ServerArgs(api_key_file=str(tmp_path / "missing"))  # refused before anything starts


def test_each_key_is_compared_in_constant_time_every_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest

    def counting(a, b):
        calls.append(len(b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    keys = (KEY, OTHER, "x")
    assert auth.key_matches(f"Bearer {KEY}", keys) and calls == [len(k) for k in keys]  # no early exit
    assert auth.key_matches(f"bearer {OTHER}", keys)
    for header in (None, "", KEY, f"Basic {KEY}", f"Bearer {KEY}x", "Bearer "):
        assert not auth.key_matches(header, keys), header


# -- TLS -------------------------------------------------------------------------------------------


def server_certificate(tmp_path):
    """A certificate for 127.0.0.1 from a CA made here: (the --ssl-* flags, the CA)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    key_pem, cert_pem = tmp_path / "server.key", tmp_path / "server.pem"
    cert.private_key_pem.write_to_path(str(key_pem))
    cert.cert_chain_pems[0].write_to_path(str(cert_pem))
    return ["--ssl-keyfile", str(key_pem), "--ssl-certfile", str(cert_pem)], ca


def https_server(tiny_v3, tmp_path, *flags: str, env: dict | None = None):
    """`afd serve` over HTTPS with a certificate for 127.0.0.1 from a CA made here: (proc, url, ca)."""
    from tests.process_helpers import afd_start, free_port

    tls, ca = server_certificate(tmp_path)
    port = free_port()
    proc = afd_start(*serve_args(tiny_v3, port), *tls, *flags, env=env)
    return proc, f"https://127.0.0.1:{port}", ca


def wait_https(url: str, proc, **client) -> None:
    import time

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            httpx.get(url + "/health", timeout=1, **client)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("the HTTPS server did not come up")


def stop(proc) -> None:
    proc.terminate()
    proc.wait(timeout=15)


def test_one_server_with_keys_from_everywhere_over_mutual_tls(tiny_v3, tmp_path):
    """One server (each costs seconds): keys from two flags, a file and the environment, HTTPS with
    a certificate from a CA made here, client certificates required (mutual TLS), the official client."""
    import trustme

    client_ca = trustme.CA()
    client_ca_pem, keys_file = tmp_path / "clients.pem", tmp_path / "keys"
    client_ca.cert_pem.write_to_path(str(client_ca_pem))
    keys_file.write_text("# one per line\nfrom-a-file\n")
    flags = ["--api-key", KEY, "--api-key", OTHER, "--api-key-file", str(keys_file)]
    flags += ["--ssl-ca-certs", str(client_ca_pem)]
    proc, url, ca = https_server(tiny_v3, tmp_path, *flags, env={auth.ENV_KEY: "from-env"})
    keys = (KEY, OTHER, "from-a-file", "from-env")
    mine = client_ca.issue_cert("client@example.org").private_key_and_cert_chain_pem
    try:
        with ca.cert_pem.tempfile() as ca_file, mine.tempfile() as mine_file:
            tls = ssl.create_default_context(cafile=ca_file)
            tls.load_cert_chain(mine_file)
            wait_https(url, proc, verify=tls)
            for key in keys:
                client = openai.OpenAI(
                    base_url=url + "/v1", api_key=key, max_retries=0, http_client=httpx.Client(verify=tls)
                )
                reply = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert reply.usage.completion_tokens == 2
            wrong = openai.OpenAI(
                base_url=url + "/v1", api_key="wrong", max_retries=0, http_client=httpx.Client(verify=tls)
            )
            with pytest.raises(openai.AuthenticationError) as err:
                wrong.models.list()
            assert "wrong" not in str(err.value)
            gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            native = httpx.post(url + "/generate", json=gen, verify=tls)
            assert native.status_code == 401 and native.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(url + "/health", verify=tls).status_code == 200
            assert httpx.get(url + "/metrics", verify=tls).status_code == 200
            with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
                httpx.get(url + "/health", verify=ssl.create_default_context(cafile=ca_file)).raise_for_status()
        with pytest.raises(httpx.ConnectError, match="(?i)certificate verify failed"):
            httpx.get(url + "/health")  # a certificate from a CA the client does not trust
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https", "http") + "/health")  # no plain HTTP on the port
    finally:
        stop(proc)
    log = proc.stdout.read()
    # the banner's example: the HTTPS URL, and the variable rather than any key
    assert f"ready; try:\n  curl {url}/v1/chat/completions" in log and "Bearer $AFD_API_KEY" in log
    for key in keys:
        assert key not in log


def test_tls_flags_are_checked_before_anything_starts(tmp_path):
    (tmp_path / "k").write_text("x")
    with pytest.raises(ConfigError, match="--ssl-keyfile and --ssl-certfile go together"):
        ServerArgs(ssl_keyfile=str(tmp_path / "k"))
    with pytest.raises(ConfigError, match="--ssl-certfile=.*/nope: no such file"):
        ServerArgs(ssl_keyfile=str(tmp_path / "k"), ssl_certfile=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="--ssl-ca-certs checks client certificates over HTTPS"):
        ServerArgs(ssl_ca_certs=str(tmp_path / "k"))


@pytest.mark.timeout(300)
def test_serve_pd_serves_https_with_the_key(tiny_v3, tmp_path):
    """`afd serve --pd` with TLS: its router answers over HTTPS (the official client, a certificate
    from a CA made here) and requires the key; its instances get neither flag on their command lines."""
    from tests.process_helpers import afd_start, free_port
    from tests.server.test_engine_death import children

    tls, ca = server_certificate(tmp_path)
    port = free_port()
    url = f"https://127.0.0.1:{port}"
    proc = afd_start(
        "serve", "--pd", "--model-path", tiny_v3, "--port", str(port), "--num-threads", "1",
        "--kv-cache-memory-mb", "16", "--served-model-name", "tiny",
        *tls, env={auth.ENV_KEY: KEY},
    )  # fmt: skip
    try:
        with ca.cert_pem.tempfile() as ca_file:
            tls = ssl.create_default_context(cafile=ca_file)
            wait_https(url, proc, verify=tls)
            client = openai.OpenAI(
                base_url=url + "/v1", api_key=KEY, max_retries=0, http_client=httpx.Client(verify=tls)
            )
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert reply.usage.completion_tokens == 3
            client.close()
            gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
            assert httpx.post(url + "/generate", json=gen, verify=tls).status_code == 401
        with pytest.raises(httpx.TransportError):
            httpx.get(url.replace("https", "http") + "/health")  # no plain HTTP on the port
        for pid in children(proc.pid):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except FileNotFoundError:
                continue
            assert "--ssl-keyfile" not in cmdline and KEY not in cmdline
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
