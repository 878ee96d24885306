"""Faults a served endpoint shows only through its HTTP answers: prompt logprobs, token ids, streaming, stops,
eos, chat rendering and batch composition. Killed by the endpoint.* checks, which the runner points at the
mutated package's own server (`parity --endpoint self --dtype float32`)."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="endpoint.scoring.prompt_logprobs_off_by_one", quick=True,
        fault="echo's prompt logprobs give token i+1 its logprob under the distribution after token i+1 instead of "
              "after token i",
        target="k3verify.serving.prompt_logprobs:prompt_logprobs",
        old="logits.all_logits[:-1], prompt_ids[1:]",
        new="logits.all_logits[1:], prompt_ids[1:]",
        killers=["endpoint.logprobs.prompt"],
    ),
    Mutant(
        id="endpoint.render.token_ids_off_by_one",
        fault="return_tokens_as_token_ids names every token by its id plus one",
        target="k3verify.api.render:Renderer.token",
        old='f"token_id:{token_id}"',
        new='f"token_id:{token_id + 1}"',
        killers=["endpoint.greedy.tokens"],
    ),
    Mutant(
        id="endpoint.render.stream_final_chunk_dropped",
        fault="a streamed answer never sends its final chunk: the last token and the finish reason are lost",
        target="k3verify.api.render:Renderer.chunks",
        old="if event.text or event.logprobs or event.finished:",
        new="if (event.text or event.logprobs) and not event.finished:",
        killers=["endpoint.stream.identity"],
    ),
    Mutant(
        id="endpoint.request.stop_string_kept",
        fault="a stop string ends generation but stays in the returned text (with whatever followed it in its token)",
        target="k3verify.serving.request:Request.append",
        old='end, finish = stop_at, "stop"',
        new='end, finish = len(self.text), "stop"',
        killers=["endpoint.stop.strings"],
    ),
    Mutant(
        id="endpoint.engine.lowest_eos_only",
        fault="a request stops only at the lowest eos id, running past generation_config's other eos",
        target="k3verify.serving.engine:Engine.submit",
        old="set() if params.ignore_eos else set(self.eos_token_ids)",
        new="set() if params.ignore_eos else set(sorted(self.eos_token_ids)[:1])",
        killers=["endpoint.stop.eos"],
    ),
    Mutant(
        id="endpoint.chat.no_generation_prompt",
        fault="chat prompts are rendered without the generation prompt (the assistant turn is never opened)",
        target="k3verify.api.state:template_chat_encoder",
        old="return encode_chat(tokenizer, messages, tools=tools)",
        new="return encode_chat(tokenizer, messages, tools=tools, add_generation_prompt=False)",
        killers=["endpoint.chat.template"],
    ),
    Mutant(
        id="endpoint.engine.batch_rows_reversed",
        fault="with more than one sequence in a step, sampled tokens are handed to the requests in reverse order",
        target="k3verify.serving.step_loop:StepLauncher.collect",
        old="zip(step.seq_ids, tokens, bad, lps,",
        new="zip(step.seq_ids, tokens[::-1], bad, lps[::-1],",
        killers=["endpoint.batch.invariance"],
    ),
    Mutant(
        id="endpoint.render.topk_one_position_late",
        fault="a completion's top_logprobs are reported one position late (each generated position shows the "
              "alternatives of the position before it)",
        target="k3verify.api.render:CompletionRenderer._logprobs",
        old="top_logprobs=[top(lp) for lp in prompt.logprobs] + [top(lp) for lp in entries],",
        new="top_logprobs=[top(lp) for lp in prompt.logprobs] + [top(lp) for lp in entries[:1] + entries[:-1]],",
        killers=["endpoint.logprobs.topk"],
    ),
]
