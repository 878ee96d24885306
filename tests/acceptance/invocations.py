"""The invocation matrix: every documented `k3verify parity` invocation, on a healthy target, as one table.

CELLS run in CI (tests/acceptance/test_parity_suites.py), each must PASS with no fail, vacuous or error. MANUAL
are the documented commands CI does not run, each with its last recorded result. docs/invocations.md lists both
(tests/acceptance/test_invocation_matrix.py keeps it in step, and requires every flag of the parity parser, and
every choice of a flag that has choices, in some cell or manual command).

Placeholders in argv: K3_TINY_DIR and KL_TINY_DIR are those presets' checkpoints as `k3verify checkpoint make`
writes them to disk, KEY_FILE a report key.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cell:
    name: str
    argv: tuple[str, ...]  # after `k3verify parity`, --report-dir left out
    holds: str
    full_suite: bool = False  # also: every model-level check reports its error over depth
    lists: bool = False  # --list: prints the checks and exits 0, no report

    @property
    def command(self) -> str:
        return " ".join(("k3verify parity", *self.argv))


@dataclass(frozen=True)
class Manual:
    command: str
    result: str  # the last recorded result (docs/invocations.md says where and when)


CELLS = (
    Cell("default", (), "the README's command: k3-tiny, quick suite, bfloat16, cpu"),
    Cell("full-k3-tiny", ("--preset", "k3-tiny", "--suite", "full"),
         "every check, the dist.* ones at tp 2 ep 2 (TP-only and EP-only too); quick is a subset of full",
         full_suite=True),
    Cell("quick-k3-skew-10", ("--preset", "k3-skew-10", "--suite", "quick"),
         "the quick suite on k3-skew-10 (its full suite is a manual row)"),
    Cell("full-kl-tiny", ("--preset", "kl-tiny", "--suite", "full"), "as above on kl-tiny (its tp 2 ep 2 layout)",
         full_suite=True),
    Cell("quick-k3-tp4", ("--preset", "k3-tp4", "--suite", "quick", "--seed", "1"),
         "the one synthetic preset without a full cell, at another seed"),
    Cell("ep2", ("--ep", "2", "--only", "dist"), "the dist.* checks at tp 1 ep 2 (experts split, no tensor)"),
    Cell("tp2", ("--tp", "2", "--only", "dist"), "the dist.* checks at tp 2 ep 1"),
    Cell("tp2-ep2", ("--tp", "2", "--ep", "2", "--only", "dist", "--verbose"),
         "the dist.* checks at tp 2 ep 2, a line for each as it finishes"),
    Cell("kl-ep2", ("--preset", "kl-tiny", "--ep", "2", "--only", "dist"),
         "kl-tiny at tp 1 ep 2 (its quick suite is the full cell's subset; tp 2 ep 2 is in the full cell)"),
    Cell("kl-tp2", ("--preset", "kl-tiny", "--tp", "2", "--only", "dist"), "kl-tiny at tp 2 ep 1"),
    Cell("checkpoint-k3-float32", ("--checkpoint", "K3_TINY_DIR", "--dtype", "float32", "--device", "cpu"),
         "k3-tiny as written to disk, served-model checks in float32"),
    Cell("checkpoint-kl-bfloat16", ("--checkpoint", "KL_TINY_DIR", "--dtype", "bfloat16", "--report-key", "KEY_FILE"),
         "kl-tiny as written to disk in bfloat16, the report signed"),
    Cell("endpoint-self-float32", ("--endpoint", "self", "--dtype", "float32", "--model", "k3-tiny",
                                   "--concurrency", "2", "--max-requests", "300", "--timeout", "60"),
         "our own server for k3-tiny over HTTP in float32, with the request limits"),
    Cell("endpoint-self-bfloat16", ("--endpoint", "self", "--dtype", "bfloat16", "--preset", "kl-tiny",
                                    "--endpoint-note", "engine-in-this-process"),
         "our own server for kl-tiny over HTTP in bfloat16 (k3-tiny in bf16 is inconclusive by design: see the "
         "manual rows), with a note on how it was started"),
    Cell("list", ("--list", "--suite", "full"), "the full suite's checks, one line each", lists=True),
)

MANUAL = (
    Manual("k3verify parity --preset k3-syn-25 --suite full",
           "PASS 81 pass, 26 skipped (2-core CPU, 2026-12-06, 414 s on the loaded machine); not a CI row: the "
           "costliest full row"),
    Manual("k3verify parity --preset k3-skew-10 --suite full",
           "PASS 81 pass, 26 skipped (2-core CPU, 2026-12-06, 101 s); CI runs its quick suite"),
    Manual("k3verify parity --preset kl-tiny --endpoint http://127.0.0.1:8766 --api-key KEY --model kl-tiny",
           "against `k3verify serve --preset kl-tiny --api-key KEY --port 8766`: PASS 8 pass; without --api-key: "
           "exit 2, `401: Incorrect or missing API key`"),
    Manual("k3verify parity --endpoint self --dtype float16 --preset kl-tiny", "PASS 8 pass"),
    Manual("k3verify parity --endpoint self --dtype bfloat16",
           "INCONCLUSIVE (exit 4): 6 pass, the 2 logprobs checks skipped because the oracle's own bf16 noise on "
           "k3-tiny (0.639 of the top-5 spread) puts their bar past its cap; float16 the same. Synthetic K3 presets "
           "are verified over HTTP at --dtype float32 (the CI row)"),
    Manual("k3verify parity --merge reports/p1 reports/p2 --report-dir reports/gate",
           "k3-tiny's quick-suite gate run in two parts (`--only` each half of its check ids; the second alone is "
           "INCONCLUSIVE, exit 4: its model-level evidence is in the first): PASS merged 2 parts, 87 checks (61 "
           "pass, 26 skipped), exit 0; tests/gates/test_merge_parts.py runs it in CI and `serve` accepts the "
           "merged report"),
    Manual("k3verify parity --help", "usage, exit 0"),
    Manual("k3verify parity --endpoint http://127.0.0.1:PORT/v1 --checkpoint KL_DIR --dtype float32 --explain",
           "against upstream llama.cpp's llama-server on a transformers-written Kimi-Linear (tests/peers, run in "
           "CI): FAIL, endpoint.logprobs.topk 0.0608 against a bar of 2.5e-5; explained first by "
           "kda.l2norm_eps=rms_norm_eps (0.0608 -> 1.68e-5, 100%); --no-explain leaves the explanation out"),
    Manual("k3verify parity --endpoint http://127.0.0.1:PORT/v1 --checkpoint KL_DIR --dtype float32 "
           "--accept-convention kda.l2norm_eps=rms_norm_eps",
           "the same llama-server started with --no-cache-prompt: PASS 8 pass, endpoint.logprobs.prompt skipped "
           "(llama-server ignores echo), the accepted deviation listed first; with its prompt cache on (its default), "
           "endpoint.repeat.identity fails: a repeated 3-token prompt is answered from a wrong cached state"),
    Manual("k3verify parity --endpoint http://127.0.0.1:PORT/v1 --preset kl-tiny --timeout 1.5 --run-timeou"
           "t 60 --max-response-bytes 8388608",
           "against a server that sends one byte every 5 s (tests/endpoint/test_endpoint_hostile.py): exit 2 wit"
           "hin about 2.5 s naming the deadline, a report marked error written"),
    Manual("k3verify parity --endpoint http://127.0.0.1:PORT/v1 --preset k3-tp4 --dtype w4a8-q8act "
           "--accept-convention mla.lora_norm_eps=rms_norm_eps --accept-convention kda.l2norm_eps=rms_norm_eps "
           "--excuse-rounding-ties",
           "against llama-server on k3-tp4 (MXFP4 experts; tests/peers, run in CI): PASS 8 pass, "
           "endpoint.logprobs.prompt skipped; endpoint.logprobs.topk 3.72e-6 against a bar of 5.33e-5 after one Q8_0 "
           "rounding near-tie excused (MoE layer 1's expert input, token 4, element 32: 2.0e-4 from the boundary, "
           "window 2.3e-4); without the near-tie 0.0125. With only the MLA eps accepted: FAIL, 5.13e-5 against "
           "3.98e-5 (the KDA L2-norm eps); float32 declared: FAIL, 0.066"),
    Manual("k3verify parity --endpoint http://127.0.0.1:PORT/v1 --checkpoint KL_DIR --weights-from KL_Q8_0_GGUF "
           "--dtype w-gguf-a8 --accept-convention kda.l2norm_eps=rms_norm_eps",
           "against llama-server on llama-quantize's Q8_0 of a transformers-written Kimi-Linear (tests/peers, run in "
           "CI): PASS 8 pass, endpoint.logprobs.prompt skipped; endpoint.logprobs.topk 0.0354 against a bar of "
           "0.0511, no rounding excused; the quantization costs mean KL 0.0131 (p99 0.0684), top-1 79.2% against "
           "the checkpoint, the server adds top-k KL 3.6e-5. A copy with one block's scale negated: FAIL (0.807 "
           "against 5.7e-6); the Q4_K_M of kl-256 (its test model re-weighted: linear layers at std 0.03, "
           "embeddings and lm_head x20): PASS, top-k 0.0234 against a bar of 0.0690, no rounding excused"),
)
