"""``sim-model --token-ids``: token ids and log-probs where vLLM puts them, and
where NeMo Gym's models pass them on (``tests/gym`` puts Gym's ``vllm_model``
in front of it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from dispatcher.sim.model import SimModelConfig, build_sim_model_app
from dispatcher.sim.model_client import request_body
from tests.helpers import serve

# What Gym's vllm_model adds to a chat request with return_token_id_information.
VLLM_ASKS = {"logprobs": True, "top_logprobs": 0, "return_tokens_as_token_ids": True}


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    runner, url = await serve(build_sim_model_app(SimModelConfig(token_ids=True)))
    yield url
    await runner.cleanup()


async def post(url: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_a_chat_answer_has_vllms_logprobs_and_token_ids(sim_url: str) -> None:
    body = request_body("chat", stream=False, prompt="what is two and two?", model="m")
    answer = await post(f"{sim_url}/v1/chat/completions", {**body, **VLLM_ASKS})
    [choice] = answer["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    assert all(entry["token"].startswith("token_id:") for entry in content)
    assert all(entry["logprob"] < 0 and entry["top_logprobs"] == [] for entry in content)
    assert "prompt_token_ids" not in answer and "token_ids" not in choice

    answer = await post(
        f"{sim_url}/v1/chat/completions", {**body, **VLLM_ASKS, "return_token_ids": True}
    )
    [choice] = answer["choices"]
    generated = [
        int(entry["token"].removeprefix("token_id:")) for entry in choice["logprobs"]["content"]
    ]
    assert choice["token_ids"] == generated
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    # /tokenize gives the prompt the same ids (Gym asks it when the answer has none).
    tokens = await post(f"{sim_url}/tokenize", {"model": "m", "messages": body["messages"]})
    assert tokens["tokens"] == answer["prompt_token_ids"]
    assert tokens["count"] == len(tokens["tokens"])


async def test_without_asking_a_chat_answer_has_none(sim_url: str) -> None:
    body = request_body("chat", stream=False, prompt="q", model="m")
    answer = await post(f"{sim_url}/v1/chat/completions", body)
    assert "logprobs" not in answer["choices"][0] and "prompt_token_ids" not in answer


async def test_a_responses_answer_has_gyms_training_fields_on_its_last_item(sim_url: str) -> None:
    body = request_body("responses", stream=False, prompt="q", model="m")
    answer = await post(f"{sim_url}/v1/responses", body)
    *earlier, last = answer["output"]
    assert len(last["generation_token_ids"]) == len(last["generation_log_probs"])
    assert len(last["generation_token_ids"]) == answer["usage"]["output_tokens"]
    assert len(last["prompt_token_ids"]) == answer["usage"]["input_tokens"]
    assert not any("prompt_token_ids" in item for item in earlier)
