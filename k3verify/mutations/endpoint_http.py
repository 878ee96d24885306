"""Faults in what our HTTP server renders, collects and reads (api/render.py, api/generation.py,
api/body.py): text and logprobs, streamed and not. Each is killed by an endpoint check run against the mutated
package's own server (`parity --endpoint self --dtype float32`), as in mutations/endpoint.py."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

MUTANTS = [
    Mutant(
        id="endpoint.render.stream_logprobs_from_start",
        fault="every streamed completion chunk carries the logprobs of all tokens so far instead of its own (the "
              "chunk's first logprob index is 0, not where the chunk starts)",
        target="k3verify.api.render:Renderer.chunks",
        old="out.append(self._chunk(event.text, start))",
        new="out.append(self._chunk(event.text, 0))",
        killers=["endpoint.stream.identity"],
    ),
    Mutant(
        id="endpoint.render.top_logprobs_drop_first",
        fault="a completion's top_logprobs leave out the most likely alternative at every position (streamed and "
              "not)",
        target="k3verify.api.render:CompletionRenderer._logprobs",
        old="for t, v in lp.top}",
        new="for t, v in lp.top[1:]}",
        killers=["endpoint.logprobs.topk"],
    ),
    Mutant(
        id="endpoint.render.plain_delta_finishes",
        fault="a streamed completion without logprobs frames its finishing event as a plain text delta: the finish "
              "reason and the usage chunk are never sent",
        target="k3verify.api.render:Renderer.sse_chunks",
        old="if not self.plain_deltas() or event.logprobs or event.finished or self.finish_reason is not None:",
        new="if not self.plain_deltas() or event.logprobs or self.finish_reason is not None:",
        killers=["endpoint.stream.identity"],
    ),
    Mutant(
        id="endpoint.generation.stream_stops_before_last_chunk",
        fault="a stream stops at the finishing event before sending its chunks: the last tokens, the finish reason "
              "and the usage never reach the client (the stream still ends with [DONE])",
        target="k3verify.api.generation:sse_stream",
        old="        for sse in renderer.sse_chunks(event):\n            yield sse\n        if event.finished:\n"
            "            break",
        new="        if event.finished:\n            break\n        for sse in renderer.sse_chunks(event):\n"
            "            yield sse",
        killers=["endpoint.stream.identity"],
    ),
    Mutant(
        id="endpoint.body.latin1",
        fault="request bodies are decoded as ISO-8859-1 (HTTP's old default charset for text) instead of UTF-8: "
              "non-ASCII text in a prompt or a chat message reaches the tokenizer as mojibake",
        target="k3verify.api.body:parse_body",
        old="data = json.loads(raw, parse_constant=reject_constant)",
        new='data = json.loads(raw.decode("latin-1"), parse_constant=reject_constant)',
        killers=["endpoint.chat.template"],
    ),
]
