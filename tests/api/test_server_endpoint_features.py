"""What the endpoint checks (and vLLM-style clients) need from our server: echo with prompt logprobs, token ids in
logprobs, logit_bias, and /tokenize, /detokenize."""

from __future__ import annotations

import httpx
import torch
from server_harness import TINY, RunningServer, make_tiny_runner, tiny_parts

from k3verify.serving.batch import PackedBatch
from k3verify.tokenizer import encode_chat

PROMPT = [5, 2000, 17, 999, 3, 250, 41]


def post(server: RunningServer, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json={"model": TINY, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_prompt_logprobs_are_the_served_models_own(tiny_server: RunningServer) -> None:
    """echo=true: the prompt leads the answer, position 0 is null, position i is log p(prompt[i] | prompt[:i])
    under a plain forward of the same weights, with the top-k alongside."""
    answer = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                   "logprobs": 3, "echo": True, "return_tokens_as_token_ids": True})
    lp = answer["choices"][0]["logprobs"]
    model = make_tiny_runner().model
    logits = model.prefill(PackedBatch.build(torch.tensor(PROMPT), [len(PROMPT)]), all_logits=True).all_logits
    want = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(PROMPT) - 1), PROMPT[1:]]
    assert lp["tokens"][: len(PROMPT)] == [f"token_id:{t}" for t in PROMPT] and len(lp["tokens"]) == len(PROMPT) + 2
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1: len(PROMPT)]), want, atol=1e-5)
    assert all(len(top) == 3 for top in lp["top_logprobs"][1:])
    prompt_text = tiny_parts()[2].decode_bytes(PROMPT).decode("utf-8", errors="replace")
    assert answer["choices"][0]["text"].startswith(prompt_text)
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) and answer["usage"]["completion_tokens"] == 2


def test_logit_bias_steers_the_choice_not_the_logprobs(tiny_server: RunningServer) -> None:
    """+100 on a token makes it the greedy answer; its reported logprob stays the raw model's."""
    plain = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 5,
                                                  "return_tokens_as_token_ids": True})
    top = plain["choices"][0]["logprobs"]["top_logprobs"][0]
    runner_up = list(top)[1]
    forced = post(tiny_server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                                                   "logprobs": 0, "return_tokens_as_token_ids": True,
                                                   "logit_bias": {runner_up.removeprefix("token_id:"): 100}})
    lp = forced["choices"][0]["logprobs"]
    assert lp["tokens"] == [runner_up] and lp["token_logprobs"][0] == top[runner_up]


def test_chat_logprobs_name_token_ids_and_keep_bytes(tiny_server: RunningServer) -> None:
    answer = post(tiny_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3, "temperature": 0, "logprobs": True,
                                                        "top_logprobs": 2, "return_tokens_as_token_ids": True})
    _, _, tok = tiny_parts()
    for entry in answer["choices"][0]["logprobs"]["content"]:
        token_id = int(entry["token"].removeprefix("token_id:"))
        assert bytes(entry["bytes"]) == (tok.token_bytes(token_id) if token_id < tok.n_vocab else
                                         f"<|unused_{token_id}|>".encode())


def test_tokenize_gives_the_ids_completions_and_chat_use(tiny_server: RunningServer) -> None:
    """/tokenize: a prompt encodes as completions encode it, messages as the chat template renders them;
    /detokenize inverts it."""
    _, _, tok = tiny_parts()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}]
    chat = post(tiny_server, "/tokenize", {"messages": messages})
    assert chat["tokens"] == encode_chat(tok, messages) and chat["count"] == len(chat["tokens"])
    text = post(tiny_server, "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert text["tokens"] == tok.encode("hello world") and "".join(text["token_strs"]) == "hello world"
    assert text["max_model_len"] == tiny_server.runner.max_context
    assert post(tiny_server, "/detokenize", {"tokens": text["tokens"]}) == {"prompt": "hello world"}
    r = httpx.post(f"{tiny_server.url}/tokenize", json={"model": "other", "prompt": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
