"""Token sampling on the model's device: greedy, temperature, top-k, top-p, counter-based seeds, logprobs.

`sample_tokens` is the contract the engine (and speculative scoring) call. A sampled row draws
its noise from a counter-based generator: integer hashing of (request seed, token position, vocab id)
in torch ops, so a seeded request draws the same numbers whatever shares its batch, on CPU and CUDA
alike, and nothing is read back to the host. The draw is a Gumbel-max on log-probabilities shifted so
the row maximum is 0 and divided by a temperature clamped into [MIN_TEMPERATURE, MAX_TEMPERATURE]: no
exp of a large number, no overflow, whatever the temperature (a temperature of 1e-30 behaves as greedy
instead of overflowing a softmax). Whether the *logits* themselves are batch-invariant depends on the
device and dtype (README, "Seeded sampling").
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3verify.kernels.pinned import to_device

MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-6  # a positive temperature below this samples as it would at this one (both ~greedy)
MAX_TOP_K = 1 << 20
MAX_NEW_TOKENS = 1 << 20
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 forces it
MAX_LOGIT_BIAS_TOKENS = 1024
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # the OpenAI seed range; reduced to 64 bits for the hash

_M32 = 0xFFFFFFFF
ACCEPT_STREAM = 1
_NOISE_BITS = 23  # uniforms (2 k + 1) / 2^24: odd integers below 2^24 are exact in fp32, so never 0 or 1


def _finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return float(value)


def _integer(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}]; got {value!r}")
    return value


class VocabError(ValueError):
    """A token id outside the model's vocabulary; `param` names the request field it came from."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler and the stop logic. temperature 0 means greedy.
    Every numeric field is range-checked on construction; `check_vocab` adds the model's vocabulary."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token plus the top k
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling)
    cache_key: str | None = None  # whose prefix-cache entries the request may use (--prefix-cache-per-key); None: all

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1, MAX_NEW_TOKENS)
        if not 0.0 <= _finite_number("temperature", self.temperature) <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}]; got {self.temperature}")
        if not 0.0 < _finite_number("top_p", self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        _integer("top_k", self.top_k, -1, MAX_TOP_K)
        if self.seed is not None:
            _integer("seed", self.seed, SEED_MIN, SEED_MAX)
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids; got {len(self.stop_token_ids)}")
        for t in self.stop_token_ids:
            _integer("stop_token_ids[]", t, 0, 2**31 - 1)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_TOKENS} logit_bias entries; got {len(self.logit_bias)}")
        for t, bias in self.logit_bias:
            _integer("logit_bias token id", t, 0, 2**31 - 1)
            if not -MAX_LOGIT_BIAS <= _finite_number("logit_bias value", bias) <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; got {bias}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise VocabError naming the field and any stop token id or logit_bias id outside the vocabulary."""
        for param, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise VocabError(param, f"{param} must name token ids in [0, {vocab_size}); got {bad[:5]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the top-k alternatives (under the raw model distribution)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def request_seed(seed: int | None) -> int:
    """The int64 key a request's draws are hashed from: its seed reduced to 64 bits, else fresh OS entropy."""
    raw = secrets.randbits(64) if seed is None else seed & ((1 << 64) - 1)
    return raw - (1 << 64) if raw >= 1 << 63 else raw


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): split c in 16-bit halves so no product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (xorshift-multiply, lowbias32 constants) on int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = 0) -> torch.Tensor:
    """[B, V] fp32 uniforms in (0, 1), a pure function of (seeds[b], positions[b], v, stream): no generator state.
    Stream 0 is the token draw; other streams are independent numbers for the same position (speculative
    acceptance draws its coin from stream ACCEPT_STREAM)."""
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32  # arithmetic shift, masked: the high word as unsigned
    key = _mix32(_mix32(hi ^ 0x9E3779B9) ^ lo)
    if stream:
        key = _mix32(key ^ ((stream * 0x27D4EB2F) & _M32))
    key = _mix32(key ^ (positions & _M32))[:, None]  # [B, 1]
    key2 = _mix32(key ^ 0x85EBCA6B)
    ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)[None, :]
    bits = _mix32(_mix32((key + ids) & _M32) ^ key2) >> (32 - _NOISE_BITS)
    return (bits * 2 + 1).to(torch.float32) * (2.0 ** -(_NOISE_BITS + 1))


def _host_column(values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A per-row parameter as a [B, 1] device tensor; pinned + non_blocking on CUDA so the copy does not wait."""
    return to_device(values, device, dtype)[:, None]


def _filter_sorted(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k and outside its top-p nucleus of the [B, V] scaled logits."""
    vocab = scaled.shape[-1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    sorted_vals, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)[None, :]
    drop = rank >= _host_column(ks, torch.int64, scaled.device)
    if any(p.top_p < 1.0 for p in params):
        probs = torch.softmax(sorted_vals.masked_fill(drop, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        top_p = _host_column([p.top_p for p in params], torch.float32, scaled.device)
        drop |= mass_before >= top_p  # rank 0 always survives: its mass_before is 0 < top_p
    return scaled.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def masked_scaled_logits(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] (z - max z) / T with tokens outside top-k / top-p at -inf: the log-weights a sampled row draws from."""
    temps = [min(max(p.temperature, MIN_TEMPERATURE), MAX_TEMPERATURE) for p in params]
    scaled = (z - z.max(dim=-1, keepdim=True).values) / _host_column(temps, torch.float32, z.device)
    if any(0 < p.top_k < z.shape[-1] or p.top_p < 1.0 for p in params):
        scaled = _filter_sorted(scaled, params)
    return scaled


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] standard Gumbel noise of the token draw (stream 0)."""
    return -torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))


def token_distribution(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V] fp32 probabilities a sampled request draws its token from, for one logit row."""
    return torch.softmax(masked_scaled_logits(row.float()[None], [params])[0], dim=-1)


def draw_from(probs: torch.Tensor, seed: int, position: int) -> int:
    """One token from a [V] distribution with the request's stream-0 noise at `position` (Gumbel-max): for
    token_distribution(row) it is the token sample_tokens draws from that row."""
    g = gumbel_noise(torch.tensor([seed], device=probs.device), torch.tensor([position], device=probs.device),
                     probs.numel())[0]
    return int(torch.argmax(torch.log(probs.float()) + g))


def accept_coin(seed: int, position: int) -> float:
    """The request's uniform in (0, 1) for accepting a draft at `position`, independent of its token draw there."""
    return float(uniform_noise(torch.tensor([seed]), torch.tensor([position]), 1, stream=ACCEPT_STREAM)[0, 0])


def sample_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """Tokens [B] int64 for [B, V] finite logits, on the logits' device, with no host sync.

    Greedy rows are the argmax. A sampled row is argmax((z - max z) / T + g) over the top-k/top-p survivors,
    g Gumbel noise hashed from (seeds[b], positions[b], v): a draw from softmax(z / T) restricted to them."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or seeds.shape != (len(params),) \
            or positions.shape != (len(params),):
        raise ValueError(f"logits {tuple(logits.shape)}, seeds {tuple(seeds.shape)}, positions "
                         f"{tuple(positions.shape)} vs {len(params)} params")
    z = logits.float()
    greedy = torch.argmax(z, dim=-1)
    if all(p.is_greedy for p in params):
        return greedy
    drawn = torch.argmax(masked_scaled_logits(z, params) + gumbel_noise(seeds, positions, z.shape[-1]), dim=-1)
    is_greedy = _host_column([p.is_greedy for p in params], torch.bool, z.device)[:, 0]
    return torch.where(is_greedy, greedy, drawn)


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: Sequence[int | None]
) -> list[TokenLogprob | None]:
    """Logprob of tokens[i] under row i of [n, V] logits, with the num_top[i] most likely; None where not asked."""
    out: list[TokenLogprob | None] = [None] * len(tokens)
    rows = [i for i, k in enumerate(num_top) if k is not None]
    if not rows:
        return out
    logp = torch.log_softmax(logits[rows].float(), dim=-1)
    for j, i in enumerate(rows):
        k = min(int(num_top[i] or 0), logp.shape[-1])
        top = torch.topk(logp[j], k) if k else None
        pairs = () if top is None else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        out[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]), pairs)
    return out


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[n, V] logits with each row's logit_bias added: `logits` itself when no row has a bias, else a biased copy.
    Logprobs stay those of the raw model distribution: only the choice of token is biased."""
    rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    biased = logits.clone()
    for i, pairs in rows:
        ids = torch.tensor([t for t, _ in pairs], device=logits.device)
        biased[i, ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return biased


def nonfinite_mask(logits: torch.Tensor) -> torch.Tensor:
    """[B] bool, on the logits' device: rows holding NaN or +inf (-inf is a legitimate mask value), or no
    finite value at all (nothing could be drawn)."""
    return torch.isnan(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)


def nonfinite_rows(logits: torch.Tensor) -> list[int]:
    """The indices of nonfinite_mask's rows (one host transfer)."""
    return nonfinite_mask(logits).nonzero().flatten().tolist()
