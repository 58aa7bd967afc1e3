"""The weather environment: one tool, ``get_weather(city)``, served over HTTP, and a verifier.

Data is deterministic: a fixed table for well-known cities, and for any other city values derived
from the sha256 of its normalized name, so every city has stable weather across runs and machines.

Tools server (FastAPI, 127.0.0.1 only):

- ``POST /get_weather`` with ``{"city": "Paris"}`` → ``{"city": "Paris", "temperature_c": 18,
  "condition": "partly cloudy", "humidity_pct": 62, "wind_kph": 14}``; 422 without ``city``;
- ``GET /health`` → ``{"status": "ok"}``.

Reward (``verify``): for each expected city, 0.5 when the agent called ``get_weather`` with it and
0.5 when the final message states its temperature (the integer, e.g. "18" in "18°C"); the reward is
the mean over expected cities, in ``[0, 1]``. Expected cities come from the task's
``verifier_metadata.cities`` when given, else from the table cities named in the user input. A task
with no expected city scores 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel

TOOL_NAME = "get_weather"

# The description names what the tool returns and when to call it: with the bare "Get the current
# weather in a city." the 1.5B embedded model answered "Is it raining in Tokyo right now?" by
# describing the call it would make instead of making it (measured greedy on eight questions: 6
# called the tool, then 7 with this description; see docs/getting-started.md#run-the-demo).
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": TOOL_NAME,
    "description": "Get the current weather in a city: temperature in degrees Celsius, condition (sunny, rain, "
    "snow, ...), humidity and wind. Call it for any question about the weather.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"],
    },
}

INSTRUCTIONS = (
    "You are a helpful assistant. To answer questions about the weather, call the get_weather tool, "
    "then answer the user briefly, stating the temperature in degrees Celsius."
)

CONDITIONS = ("sunny", "partly cloudy", "cloudy", "light rain", "rain", "thunderstorms", "fog", "snow", "windy")

# (temperature_c, condition, humidity_pct, wind_kph); fixed so demos and tests read naturally.
_TABLE: dict[str, tuple[int, str, int, int]] = {
    "Paris": (18, "partly cloudy", 62, 14),
    "London": (14, "light rain", 81, 20),
    "Tokyo": (22, "rain", 88, 11),
    "New York": (25, "sunny", 48, 9),
    "Berlin": (16, "cloudy", 70, 17),
    "Cairo": (34, "sunny", 21, 12),
    "Sydney": (20, "windy", 55, 31),
    "Moscow": (-3, "snow", 85, 15),
    "San Francisco": (15, "fog", 90, 19),
    "Mumbai": (31, "thunderstorms", 84, 23),
}
_CANONICAL = {name.casefold(): name for name in _TABLE}


def normalize_city(city: str) -> str:
    """``" paris, France "`` → ``"Paris"``: drop the country/region after a comma, trim, and use the
    table's spelling when known, else title case."""
    base = city.split(",")[0].strip()
    base = re.sub(r"\s+", " ", base)
    return _CANONICAL.get(base.casefold(), base.title())


def get_weather(city: str) -> dict[str, Any]:
    """Deterministic current weather of ``city`` (see module doc for the shape). Raises ValueError
    on an empty name."""
    name = normalize_city(city)
    if not name:
        raise ValueError("city must be a non-empty name, e.g. 'Paris'")
    if name in _TABLE:
        temp, cond, hum, wind = _TABLE[name]
    else:
        h = hashlib.sha256(name.casefold().encode()).digest()
        temp = h[0] % 46 - 10  # -10..35 °C
        cond = CONDITIONS[h[1] % len(CONDITIONS)]
        hum = 20 + h[2] % 76
        wind = h[3] % 40
    return {"city": name, "temperature_c": temp, "condition": cond, "humidity_pct": hum, "wind_kph": wind}


class WeatherRequest(BaseModel):
    """Body of ``POST /get_weather`` (module level: FastAPI resolves annotations by module globals)."""

    city: str


def create_app():
    """The tools server as a FastAPI app (serve it with ``BackgroundApp`` or uvicorn on 127.0.0.1)."""
    from fastapi import FastAPI, HTTPException

    app = FastAPI(title="gymserve weather tools")

    @app.post("/get_weather")
    async def _get_weather(req: WeatherRequest) -> dict[str, Any]:
        try:
            return get_weather(req.city)
        except ValueError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    @app.get("/health")
    async def _health() -> dict[str, str]:
        return {"status": "ok"}

    return app


# ---------------------------------------------------------------------------------------------
# Verification


def _text_of_content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def user_text(task: dict[str, Any]) -> str:
    """All user-message text of a task's ``responses_create_params.input`` (a string or items)."""
    inp = task.get("responses_create_params", {}).get("input", "")
    if isinstance(inp, str):
        return inp
    return "\n".join(
        _text_of_content(it.get("content")) for it in inp if isinstance(it, dict) and it.get("role") == "user"
    )


def expected_cities(task: dict[str, Any]) -> list[str]:
    """``verifier_metadata.cities`` when given, else the table cities the user input names."""
    meta = task.get("verifier_metadata") or {}
    if meta.get("cities"):
        return [normalize_city(c) for c in meta["cities"]]
    text = user_text(task).casefold()
    return [name for name in _TABLE if re.search(rf"\b{re.escape(name.casefold())}\b", text)]


def final_message_text(output_items: list[dict[str, Any]]) -> str:
    """The text of the last ``message`` output item (empty when the agent never answered)."""
    for item in reversed(output_items):
        if item.get("type") == "message" and item.get("role", "assistant") == "assistant":
            return _text_of_content(item.get("content"))
    return ""


def called_cities(output_items: list[dict[str, Any]]) -> set[str]:
    """Normalized cities of every well-formed ``get_weather`` function call."""
    cities = set()
    for item in output_items:
        if item.get("type") != "function_call" or item.get("name") != TOOL_NAME:
            continue
        try:
            args = json.loads(item.get("arguments") or "{}")
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict) and isinstance(args.get("city"), str) and args["city"].strip():
            cities.add(normalize_city(args["city"]))
    return cities


def verify(task: dict[str, Any], output_items: list[dict[str, Any]]) -> float:
    """Reward in ``[0, 1]`` of a finished rollout (scoring rule in the module doc)."""
    cities = expected_cities(task)
    if not cities:
        return 0.0
    called = called_cities(output_items)
    answer = final_message_text(output_items)
    score = 0.0
    for city in cities:
        if city in called:
            score += 0.5
        temp = get_weather(city)["temperature_c"]
        if re.search(rf"(?<![\d.]){temp}(?![\d])", answer):
            score += 0.5
    return score / len(cities)


# ---------------------------------------------------------------------------------------------
# The environment object the agent uses


class WeatherEnv:
    """The weather environment, calling its tools server at ``tools_url`` over HTTP.

    ``WeatherEnv.serve()`` starts a tools server and yields an env bound to it.
    """

    name = "weather"
    tools = [WEATHER_TOOL]
    instructions: str | None = INSTRUCTIONS

    def __init__(self, tools_url: str, *, timeout: float = 30.0):
        import httpx

        self.tools_url = tools_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.tools_url, timeout=timeout)

    async def call_tool(self, name: str, arguments: str) -> str:
        """Run one function call; returns the JSON text for ``function_call_output.output``.

        Bad tool names, unparsable arguments and tool-server errors come back as
        ``{"error": "..."}`` so the model sees what went wrong (that is part of the environment).
        """
        if name != TOOL_NAME:
            return json.dumps({"error": f"unknown tool {name!r}; available tools: {TOOL_NAME}"})
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError as exc:
            return json.dumps({"error": f"arguments are not valid JSON: {exc}"})
        if not isinstance(args, dict) or not isinstance(args.get("city"), str):
            return json.dumps({"error": 'get_weather needs {"city": "<name>"}'})
        resp = await self._http.post("/get_weather", json={"city": args["city"]})
        if resp.status_code != 200:
            return json.dumps({"error": f"weather service returned {resp.status_code}: {resp.text[:200]}"})
        return json.dumps(resp.json())

    def verify(self, task: dict[str, Any], output_items: list[dict[str, Any]]) -> float:
        return verify(task, output_items)

    async def aclose(self) -> None:
        await self._http.aclose()

    @classmethod
    @contextlib.asynccontextmanager
    async def serve(cls) -> AsyncIterator[WeatherEnv]:
        """Start the tools server on 127.0.0.1 (free port), yield an env using it, stop both."""
        import asyncio

        from gymserve.harness.envs import BackgroundApp

        app = BackgroundApp(create_app())
        await asyncio.to_thread(app.start)
        env = cls(app.url)
        try:
            yield env
        finally:
            await env.aclose()
            await asyncio.to_thread(app.stop)
