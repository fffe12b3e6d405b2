"""What a NeMo Gym user types out of habit, and what to type here instead.

Gym's ``ng_collect_rollouts`` takes Hydra overrides (``+num_repeats=4``), and
model parameters are flags of its own; a near-miss suggestion from difflib
would point such a user the wrong way (``--resume`` is closest to ``--fresh``,
which does the opposite).
"""

from __future__ import annotations

# Hydra override keys of ng_collect_rollouts -> this command line's flag.
_HYDRA_KEYS = {
    "input_jsonl_fpath": "--input",
    "output_jsonl_fpath": "--output",
    "num_repeats": "--num-repeats",
    "limit": "--limit",
    "agent_name": "--default-agent",
    "num_samples_in_parallel": "--concurrency",
}

# Flags that are a model parameter elsewhere: here they go in the requests' params.
_MODEL_PARAMETERS = ("temperature", "top_p", "max_output_tokens", "max_tokens", "model", "seed")

_FLAGS = {
    "--resume": "a rerun of the same command resumes by itself; --fresh starts over",
    "--agent-name": "here: --default-agent NAME, the agent of rows without agent_ref",
    "--num-samples-in-parallel": "here: --concurrency N",
    "--input-jsonl-fpath": "here: --input FILE",
    "--output-jsonl-fpath": "here: --output FILE",
}


def gym_hint(word: str) -> str | None:
    """The hint for one unknown word of the command line, or None if it is no Gym habit."""
    key, _, value = word.partition("=")
    if key.startswith("+"):
        return _hydra_hint(key[1:], value)
    flag = key.replace("_", "-")
    parameter = flag.removeprefix("--").replace("-", "_")
    if parameter in _MODEL_PARAMETERS:
        return _params_hint(parameter, value or "...")
    return _FLAGS.get(flag)


def _hydra_hint(key: str, value: str) -> str | None:
    if key.startswith("responses_create_params."):
        return _params_hint(key.partition(".")[2], value or "...")
    flag = _HYDRA_KEYS.get(key)
    if flag is None:
        return None
    return f"here: {flag} {value}" if value else f"here: {flag}"


def _params_hint(name: str, value: str) -> str:
    return f"--responses-create-params '{{\"{name}\": {value}}}' sets it on every request"


def agent_flag_hint(value: str) -> str:
    """The pointer for ``--agent NAME`` without a URL: Gym names the agent to run this way."""
    if "=" in value or "://" in value or "/" in value:
        return ""
    return f" (--default-agent {value} picks the agent of rows without agent_ref)"
