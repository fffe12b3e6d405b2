"""``sim-model --token-ids`` behind Gym 0.7.0's own ``vllm_model`` with
``return_token_id_information``: Gym reads the ids and log-probs where vLLM puts
them (and the prompt's ids from ``/tokenize``) and passes them on."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from dispatcher.sim.model_client import request_body
from dispatcher.sim.token_ids import generation
from tests.gym.conftest import GymStack

pytestmark = pytest.mark.timeout(600)
MODEL_SERVER = "vllm_model"


async def post(url: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession() as http, http.post(url, json=body) as answer:
        assert answer.status == 200, (await answer.text())[-2000:]
        return await answer.json()


async def test_gyms_vllm_model_passes_on_the_sims_token_ids(gym_stack: GymStack) -> None:
    body = request_body("responses", stream=False, prompt="what is two and two?", model="sim-model")
    answer = await post(f"{gym_stack.token_model_url}/v1/responses", body)
    last = answer["output"][-1]
    ids, log_probs = generation(answer["usage"]["output_tokens"])
    assert last["generation_token_ids"] == ids
    assert last["generation_log_probs"] == pytest.approx(log_probs)
    assert len(last["prompt_token_ids"]) == answer["usage"]["input_tokens"]

    body = request_body("chat", stream=False, prompt="what is two and two?", model="sim-model")
    answer = await post(f"{gym_stack.token_model_url}/v1/chat/completions", body)
    message = answer["choices"][0]["message"]
    assert message["generation_token_ids"] == ids
    assert len(message["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
