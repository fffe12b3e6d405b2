"""The simulated model's token ids and log-probs, in vLLM's shape (``sim-model --token-ids``).

A trainer learns from the tokens the engine saw and sampled, so NeMo Gym's
``vllm_model`` server (``return_token_id_information``) asks vLLM for them
and passes them on. It asks ``/v1/chat/completions`` with ``logprobs: true,
top_logprobs: 0, return_tokens_as_token_ids: true`` (and ``return_token_ids:
true`` when configured), and reads them where vLLM puts them:

- ``choices[0].logprobs.content``: one ``{"token": "token_id:<id>", "logprob",
  "bytes", "top_logprobs": []}`` per generated token;
- ``prompt_token_ids`` at the answer's top level and ``choices[0].token_ids``
  (only when ``return_token_ids``); without them it asks ``POST /tokenize``
  (``{"tokens": [...]}``) for the prompt's ids.

A Responses answer carries what Gym's models pass on instead:
``prompt_token_ids``, ``generation_token_ids`` and ``generation_log_probs`` on
its last output item (as Gym's ``*ForTraining`` items have them).

Ids are a pure function of the request: a prompt's ids are its bytes four at
a time (the sim's token count), the same at ``/tokenize`` and in the answer;
the generated ids and log-probs follow from the generated token's position.
Streamed answers carry none.
"""

from __future__ import annotations

from typing import Any

from dispatcher.sim.prefix_cache import BYTES_PER_TOKEN

JsonObject = dict[str, Any]

VOCAB_SIZE = 32_000
MAX_MODEL_LEN = 131_072


def prompt_token_ids(prompt: bytes) -> list[int]:
    """The prompt's ids: one per ``BYTES_PER_TOKEN`` bytes (at least one)."""
    count = max(1, len(prompt) // BYTES_PER_TOKEN)
    chunks = (prompt[i * BYTES_PER_TOKEN : (i + 1) * BYTES_PER_TOKEN] for i in range(count))
    return [int.from_bytes(chunk, "little") % VOCAB_SIZE for chunk in chunks]


def generation(count: int) -> tuple[list[int], list[float]]:
    """``count`` generated ids and each one's log-probability (< 0)."""
    ids = [(1000 + 7919 * i) % VOCAB_SIZE for i in range(count)]
    return ids, [-0.05 * (1 + i % 7) for i in range(count)]


def tokenize_answer(prompt: bytes) -> JsonObject:
    """What vLLM's ``POST /tokenize`` answers for a prompt."""
    ids = prompt_token_ids(prompt)
    return {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}


def add_to_chat(answer: JsonObject, body: JsonObject, prompt: bytes, completion: int) -> None:
    """vLLM's fields on a chat answer, as the request asks for them."""
    choice = answer["choices"][0]
    ids, log_probs = generation(completion)
    if body.get("logprobs"):
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choice["logprobs"] = {
            "content": [
                _logprob(token, lp, as_ids) for token, lp in zip(ids, log_probs, strict=True)
            ]
        }
    if body.get("return_token_ids"):
        answer["prompt_token_ids"] = prompt_token_ids(prompt)
        choice["token_ids"] = ids


def add_to_responses(answer: JsonObject, prompt: bytes, completion: int) -> None:
    """Gym's training fields on the last output item of a Responses answer."""
    output = answer.get("output") or []
    if not output:
        return
    ids, log_probs = generation(completion)
    output[-1]["prompt_token_ids"] = prompt_token_ids(prompt)
    output[-1]["generation_token_ids"] = ids
    output[-1]["generation_log_probs"] = log_probs


def _logprob(token: int, logprob: float, as_ids: bool) -> JsonObject:
    text = f"token_id:{token}" if as_ids else f"<{token}>"
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
