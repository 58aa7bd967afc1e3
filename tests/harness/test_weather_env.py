"""The weather environment: deterministic data, its tools server, tool calls, and verify scoring."""

from __future__ import annotations

import json

import httpx
import pytest

from gymserve.harness.envs import BackgroundApp, UnknownEnvironmentError, open_environments
from gymserve.harness.envs.weather import create_app, expected_cities, get_weather, normalize_city, verify


def test_table_city_values():
    assert get_weather("Paris") == {
        "city": "Paris",
        "temperature_c": 18,
        "condition": "partly cloudy",
        "humidity_pct": 62,
        "wind_kph": 14,
    }
    assert get_weather("  paris, France ") == get_weather("Paris")
    assert get_weather("new york")["city"] == "New York"


def test_unknown_city_is_deterministic_and_in_range():
    a, b = get_weather("Reykjavik"), get_weather("reykjavik")
    assert a == b and a["city"] == "Reykjavik"
    # Derived from sha256 of the normalized name: pin one value so a change in the rule shows.
    assert a == {"city": "Reykjavik", "temperature_c": 33, "condition": "sunny", "humidity_pct": 78, "wind_kph": 18}
    assert a == get_weather("REYKJAVIK, Iceland")
    for city in ("Oslo", "Lima", "Nairobi", "Hanoi", "Quito"):
        w = get_weather(city)
        assert -10 <= w["temperature_c"] <= 35 and 20 <= w["humidity_pct"] <= 95 and 0 <= w["wind_kph"] < 40


def test_empty_city_rejected():
    with pytest.raises(ValueError):
        get_weather("  ")
    assert normalize_city("san   francisco") == "San Francisco"


def test_tools_server_over_http():
    with BackgroundApp(create_app()) as app:
        assert app.url.startswith("http://127.0.0.1:")
        r = httpx.post(f"{app.url}/get_weather", json={"city": "Tokyo"})
        assert r.status_code == 200 and r.json() == get_weather("Tokyo")
        assert httpx.post(f"{app.url}/get_weather", json={}).status_code == 422
        assert httpx.post(f"{app.url}/get_weather", json={"city": " "}).status_code == 400
        assert httpx.get(f"{app.url}/health").json() == {"status": "ok"}


async def test_env_call_tool():
    async with open_environments(["weather"]) as envs:
        env = envs["weather"]
        assert json.loads(await env.call_tool("get_weather", '{"city": "Cairo"}')) == get_weather("Cairo")
        assert "unknown tool" in json.loads(await env.call_tool("get_time", "{}"))["error"]
        assert "not valid JSON" in json.loads(await env.call_tool("get_weather", "{city: Paris"))["error"]
        assert "needs" in json.loads(await env.call_tool("get_weather", '{"location": "Paris"}'))["error"]
        assert env.tools[0]["name"] == "get_weather" and env.instructions


async def test_unknown_env():
    with pytest.raises(UnknownEnvironmentError, match="weather"):
        async with open_environments(["chess"]):
            pass


def _task(text, **meta):
    t = {"responses_create_params": {"input": text}}
    if meta:
        t["verifier_metadata"] = meta
    return t


def _call(city):
    return {"type": "function_call", "name": "get_weather", "call_id": "c1", "arguments": json.dumps({"city": city})}


def _msg(text):
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def test_verify_scoring():
    task = _task("What's the weather in Paris?")
    assert expected_cities(task) == ["Paris"]
    assert (
        verify(
            task,
            [
                _call("Paris"),
                {"type": "function_call_output", "call_id": "c1", "output": "{}"},
                _msg("It is 18°C and partly cloudy in Paris."),
            ],
        )
        == 1.0
    )
    assert verify(task, [_call("paris, France"), _msg("It is sunny.")]) == 0.5  # called, wrong answer
    assert verify(task, [_msg("Paris: 18 C")]) == 0.5  # right answer without the tool
    assert verify(task, [_msg("It is 180 degrees or 1.18")]) == 0.0  # 18 must stand alone
    assert verify(task, []) == 0.0
    assert verify(_task("Hello there"), [_msg("hi")]) == 0.0  # no expected city


def test_verify_multiple_cities_and_metadata():
    task = _task("Compare London and Cairo")
    assert expected_cities(task) == ["London", "Cairo"]
    assert verify(task, [_call("London"), _call("Cairo"), _msg("London 14°C, Cairo 34°C")]) == 1.0
    assert verify(task, [_call("London"), _msg("London 14°C")]) == 0.5
    # Metadata wins over the text, and works for cities outside the table.
    t = get_weather("Oslo")["temperature_c"]
    meta_task = _task("how is it up north?", cities=["Oslo"])
    assert verify(meta_task, [_call("Oslo"), _msg(f"Oslo is at {t} degrees")]) == 1.0
    # Items given as input messages (a list) work too.
    list_task = {
        "responses_create_params": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Tokyo?"}]}]}
    }
    assert expected_cities(list_task) == ["Tokyo"]
