"""`--api-key`: a missing or wrong key gets 401 on every model route, the `openai` client with the key works,
/health stays open, /metrics is open or keyed as the operator chooses; the key is compared in constant time and
appears in no log line and no answer."""

import logging

import pytest
from conftest import live, need_extra

need_extra("fastapi", "uvicorn", "httpx", "openai", "prometheus_client")

import httpx  # noqa: E402
import openai  # noqa: E402

from trimvlm.errors import InputError  # noqa: E402
from trimvlm.serve.keys import Access  # noqa: E402
from trimvlm.serve.state import ServerState  # noqa: E402

from test_serve_engine import image, messages  # noqa: E402  isort: skip

pytestmark = pytest.mark.usefixtures("one_thread")  # (the demo model: conftest's `demo`)

KEY = "s3cret-key-0123"
ROUTES = [("POST", "/v1/chat/completions", {"messages": messages(3), "max_tokens": 2}),
          ("POST", "/v1/systemone", {"state": "x", "questions": {}}), ("GET", "/v1/models", None),
          ("POST", "/v1/score", {}), ("GET", "/nowhere", None)]  # fmt: skip


def test_a_missing_or_wrong_key_is_401_and_the_key_works(demo, caplog, monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr("trimvlm.serve.keys.hmac.compare_digest", lambda a, b: compared.append(1) or real(a, b))
    caplog.set_level(logging.DEBUG)
    with live(ServerState(demo, model_id="demo", access=Access(api_key=KEY))) as (url, _):
        for method, path, body in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": f"Basic {KEY}"}):  # fmt: skip
                r = httpx.request(method, url + path, json=body, headers=headers, timeout=60)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200  # open unless keyed
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert ok.status_code == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        r = c.chat.completions.create(model="demo", messages=messages(3), max_tokens=4)
        assert r.choices[0].message.content == demo.generate(image(3), "describe ?", max_new_tokens=4).texts[0]
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="demo", messages=messages(3), max_tokens=4)
    assert compared  # hmac.compare_digest decided
    assert not [r for r in caplog.records if KEY in r.getMessage()]


def test_metrics_keyed_by_the_operators_choice(demo):
    with live(ServerState(demo, model_id="demo", access=Access(api_key=KEY, key_metrics=True))) as (url, _):
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(InputError, match="--key-metrics needs --api-key"):
        ServerState(demo, model_id="demo", access=Access(key_metrics=True))
    with pytest.raises(InputError, match="--api-key"):
        ServerState(demo, model_id="demo", access=Access(api_key="  "))


def test_the_cli_reads_the_key_from_the_environment(monkeypatch):
    """`trimvlm serve` takes the key from TRIMVLM_API_KEY (typer's envvar), and its help never shows a value."""
    from typer.testing import CliRunner

    from trimvlm import cli

    seen = {}
    monkeypatch.setattr("trimvlm.serve.main.serve", lambda model, **kw: seen.update(kw))
    monkeypatch.setenv("TRIMVLM_API_KEY", KEY)
    r = CliRunner().invoke(cli.app, ["serve", "--model", "demo"])
    assert r.exit_code == 0, r.output
    assert seen["api_key"] == KEY and seen["key_metrics"] is False
    assert KEY not in CliRunner().invoke(cli.app, ["serve", "--help"]).output
