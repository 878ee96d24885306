"""The chat renderer: engine events -> chat.completion responses or chunks, tool calls parsed where the
tokenizer defines the markers (k3verify.tokenizer.tool_calls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from k3verify.api.render import (
    LOGPROB_FLOOR,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobEntry,
    ChatLogprobs,
    FunctionCallOut,
    Renderer,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
)

if TYPE_CHECKING:
    from k3verify.serving.engine import EngineEvent
    from k3verify.tokenizer.tool_calls import ToolCallParser


class ChatRenderer(Renderer):
    """Chat responses; with a tool-call parser (the tokenizer defines the markers), a well-formed tool-call
    section becomes `tool_calls` (finish_reason "tool_calls") and its text is not streamed as content; a broken
    one is returned as text."""

    chunk_model = ChatCompletionChunk

    def __init__(self, *args: Any, tool_parser: ToolCallParser | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.shown = ""  # content text sent so far (streaming)

    def plain_deltas(self) -> bool:
        return not self.want_logprobs and self.tool_parser is None

    def _logprobs(self, start: int = 0) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None

        def top(token_id: int, logprob: float) -> dict[str, Any]:
            text, raw = self.token(token_id)
            return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(raw)}

        return ChatLogprobs(content=[
            ChatLogprobEntry(**top(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**top(t, v)) for t, v in lp.top])
            for lp in self.logprobs[start:]])

    def start(self) -> list[dict[str, Any]]:
        return [_without_null_calls(self._envelope([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))],
                                                   None))]

    def _calls(self) -> tuple[str, list[ToolCallOut]] | None:
        split = self.tool_parser.split(self.token_ids) if self.tool_parser is not None else None
        if split is None:
            return None
        text, calls = split
        return text, [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
                      for c in calls]

    def chunks(self, event: EngineEvent) -> list[dict[str, Any]]:
        if self.tool_parser is None:
            return super().chunks(event)
        begin = self.tool_parser.section_begin
        started = begin in self.token_ids
        start = len(self.logprobs)
        self.add(event)
        if started:
            text = ""
        elif begin in event.token_ids:
            text = self.tool_parser.tokenizer.decode(event.token_ids[:event.token_ids.index(begin)],
                                                     skip_special=True)
        else:
            text = event.text
        calls = self._calls() if event.finished else None
        if event.finished and calls is None:
            text = self.text[len(self.shown):]  # no call after all (or a broken section): everything is text
        self.shown += text
        out = []
        if calls is not None:
            self.finish_reason = "tool_calls"
            deltas = [ToolCallDelta(index=i, **c.model_dump()) for i, c in enumerate(calls[1])]
            if text:
                out.append(self._chunk_with(ChatDelta(content=text), start, finished=False))
            out.append(self._chunk_with(ChatDelta(tool_calls=deltas), len(self.logprobs), finished=True))
        elif text or event.logprobs or event.finished:
            out.append(self._chunk(text, start))
        if event.finished and self.include_usage:
            out.append(self._envelope([], self.usage))
        return out

    def _chunk_with(self, delta: ChatDelta, first_logprob: int, finished: bool) -> dict[str, Any]:
        choice = ChatChunkChoice(delta=delta, finish_reason=self.finish_reason if finished else None,
                                 logprobs=self._logprobs(first_logprob))
        return _without_null_calls(self._envelope([choice], None))

    def _chunk(self, text: str, first_logprob: int) -> dict[str, Any]:
        delta = ChatDelta(content=text) if text else ChatDelta()
        return _without_null_calls(self._envelope([ChatChunkChoice(delta=delta, finish_reason=self.finish_reason,
                                                                   logprobs=self._logprobs(first_logprob))], None))

    def response(self) -> dict[str, Any]:
        if self.usage is None:
            raise RuntimeError("ChatRenderer.response() called before the final event")
        calls = self._calls()
        message = AssistantMessage(content=self.text) if calls is None else \
            AssistantMessage(content=calls[0] or None, tool_calls=calls[1])
        choice = ChatChoice(message=message, finish_reason="tool_calls" if calls else self.finish_reason,
                            logprobs=self._logprobs())
        out = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                     usage=self.usage).model_dump()
        if calls is None:
            del out["choices"][0]["message"]["tool_calls"]
        return out


def _without_null_calls(chunk: dict[str, Any]) -> dict[str, Any]:
    """Deltas without tool calls keep their old shape (no "tool_calls": null)."""
    for choice in chunk.get("choices", []):
        if choice.get("delta", {}).get("tool_calls", 0) is None:
            del choice["delta"]["tool_calls"]
    return chunk
