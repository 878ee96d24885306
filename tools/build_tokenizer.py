"""Build the project's own small byte-level BPE vocabulary into k3verify/tokenizer/assets/.

Deterministic: the corpus is written below (plus text generated from it by a fixed integer PRNG), the
trainer breaks ties by token id, and nothing depends on hash order, so two runs write identical bytes.

    python tools/build_tokenizer.py            # rebuild the committed assets
    python tools/build_tokenizer.py --check    # exit 1 if the committed assets differ from a rebuild
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import regex

from k3verify.tokenizer.templates import KIMI_CHAT_TEMPLATE
from k3verify.tokenizer.tokenizer import CONFIG_FILE, MODEL_FILE, NUM_SPECIAL_SLOTS, PAT_STR

REPO_ROOT = Path(__file__).resolve().parents[1]

NUM_BASE_TOKENS = 4096
DEFAULT_OUT = REPO_ROOT / "k3verify" / "tokenizer" / "assets"

# Offsets from N, in the released vocab's order (SPEC §7); [PAD] at the last slot is our choice.
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    5: "<|start_header_id|>",
    6: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|im_middle|>",
    255: "[PAD]",
}

PROSE = """\
The verifier runs the reference model and the serving model side by side on the same inputs, then
compares what they computed. When the two disagree, it says by how much, where the first difference
appears, and whether the reference itself might be the one that is wrong. A check that cannot fail is
worse than no check at all, so every comparison also runs against a deliberately broken candidate.
Tokenizers are easy to get almost right. A space before a word, a newline after a colon, a digit that
belongs to the next number: each of these changes the ids, and the model never sees the text itself.
That is why we pin exact ids for a handful of strings and check that decoding gives back the input.
Users will type anything. Someone will paste a log file with ten thousand spaces, or ask what the
token [EOS] means, or write <|im_end|> in the middle of a question to see what happens. None of that
may ever turn into a control token: user text is always encoded as plain text.
It was raining when the train left the station, and the conductor walked slowly through the carriage,
checking tickets and answering questions about connections in the next town. A child by the window
counted the bridges out loud. Her father read the newspaper and said nothing for an hour.
Good software is boring in the best way. It starts quickly, reports what it is doing, fails loudly
when something is wrong, and leaves the machine as it found it. Nobody remembers the tool that worked;
everybody remembers the one that silently dropped half of the data on a Friday evening.
We measured the throughput at batch sizes of 1, 8, 64 and 256, with prompts between 128 and 32768
tokens long. Latency stayed under 40 ms per token up to a batch of 64, then grew roughly linearly.
The memory used by the cache was 12.5 GiB at the largest setting, well within the 141 GiB available.
What's the difference between a list and a tuple? They're both sequences, but you can't change a
tuple once it's built. I'll show you an example, and we'd better test it before we ship it.
Dear Ms. Okafor, thank you for your letter of March 3rd. The parts you ordered (catalogue numbers
A-1172 and B-0093) will arrive on Tuesday. Please call us at +1 (555) 010-4477 if anything is missing.
RECIPE: Mix 200 g of flour, 2 eggs, and 300 ml of milk. Rest the batter for 30 minutes. Cook in a hot
pan, about 1 minute per side. Serves 4. Note: the first pancake is always a test; eat it yourself.
Linear attention keeps a fixed-size state instead of a growing cache, so long contexts cost memory in
proportion to the number of heads, not the number of tokens. The price is that the state must be
updated exactly, step by step, or small errors accumulate over thousands of positions.
Überall in München gibt es Cafés. À Paris, on prend le café au comptoir. En España, el café con leche
es muy común. Ο καφές είναι ζεστός. Кофе очень горячий. Café, naïve, coöperate, résumé, jalapeño.
"""

CODE = """\
def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
    \"\"\"Return the token ids of text.\"\"\"
    if not text:
        return []
    ids = []
    for piece in split(text):
        ids.extend(self._bpe(piece))
    return ids


class Scheduler:
    def __init__(self, max_batch: int = 256, max_tokens: int = 8192) -> None:
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def schedule(self) -> tuple[list[Sequence], bool]:
        scheduled, num_tokens = [], 0
        while self.waiting and len(scheduled) < self.max_batch:
            seq = self.waiting[0]
            if num_tokens + len(seq) > self.max_tokens:
                break
            num_tokens += len(seq)
            scheduled.append(self.waiting.popleft())
        return scheduled, True

for (int i = 0; i < n; ++i) {
\tif (x[i] > max_val) {
\t\tmax_val = x[i];
\t\tidx = i;
\t}
}
printf("max=%f at %d\\n", max_val, idx);

{"model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27, "vocab_size": 163840,
 "rope_theta": 50000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": false, "dtype": "bfloat16"}

SELECT name, COUNT(*) AS n FROM runs WHERE status = 'pass' GROUP BY name ORDER BY n DESC LIMIT 10;
$ pip install -e ".[test]" && pytest -q tests/ -k "not gpu"
x = torch.zeros(B, T, H, D, dtype=torch.float32)  # B batch, T tokens, H heads, D head dim
assert torch.equal(out, ref), f"max abs diff {(out - ref).abs().max().item():.3e}"
const sum = (xs) => xs.reduce((a, b) => a + b, 0);
<div class="result"><span>{{ value }}</span></div>
"""

HAN = """\
我们今天去公园散步，天气很好，阳光明媚。
这个模型的参数量很大，但是推理速度仍然很快。
请把文件保存到服务器上，然后告诉我结果。
中文分词是自然语言处理中的一个重要问题。
他说明天会下雨，所以我们要带伞出门。
学习编程需要耐心和大量的练习，不要着急。
数据中心的电力消耗一年比一年高。
这本书讲的是一个关于时间和记忆的故事。
测试通过了，可以合并代码了吗？
人工智能、机器学习、深度学习、神经网络、注意力机制、上下文长度。
東京は日本の首都です。ひらがなとカタカナも使います。
서울은 한국의 수도입니다. 감사합니다.
"""

WORDS = (
    "the of and to in is that for it as was with be on not he by this are at from his or have an they "
    "which one you had her all she there would their we him been has when who will more no if out so "
    "said what up its about into than them can only other new some could time these two may then do "
    "first any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used take "
    "model token layer cache batch kernel tensor gradient weight attention expert router norm scale shape "
    "server request response stream prompt sample decode prefill sequence position head state chunk"
).split()

HAN_CHARS = (
    "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种"
    "面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本"
    "去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比"
    "或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总"
    "次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做"
    "必战先回则任取据处府研"
)


class Rng:
    """xorshift64*: a tiny PRNG whose sequence is fixed by its seed on every Python version."""

    def __init__(self, seed: int) -> None:
        self.state = seed & (2**64 - 1) or 1

    def next(self) -> int:
        x = self.state
        x ^= (x >> 12) & (2**64 - 1)
        x ^= (x << 25) & (2**64 - 1)
        x ^= x >> 27
        self.state = x & (2**64 - 1)
        return (self.state * 0x2545F4914F6CDD1D) & (2**64 - 1)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items: tuple[str, ...] | list[str] | str) -> str:
        return items[self.below(len(items))]


def generated_text(rng: Rng) -> str:
    """Sentences, identifiers, numbers, Han runs and odd whitespace drawn from the lists above."""
    lines: list[str] = []
    indents = ("", "", "  ", "    ", "        ", "\t", "\t\t", " ")
    endings = ("\n", "\n", "\n", "\r\n", "\n\n", "  \n", "\n\n\n")
    for _ in range(2500):
        kind = rng.below(8)
        if kind <= 2:
            words = [rng.pick(WORDS) for _ in range(3 + rng.below(12))]
            if rng.below(3) == 0:
                words[0] = words[0].capitalize()
            line = " ".join(words) + rng.pick((".", ".", ",", "?", "!", ":", ";", ""))
        elif kind == 3:
            a, b, c = rng.pick(WORDS), rng.pick(WORDS), rng.pick(WORDS)
            line = rng.pick(
                (
                    f"{a}_{b} = {c}_{a}({b}, {rng.below(1000)})",
                    f"{a}{b.capitalize()}.{c}()",
                    f"self.{a}_{b}[{rng.below(64)}] += {c}",
                    f"{a.upper()}_{b.upper()} = {rng.below(99999)}",
                )
            )
        elif kind == 4:
            line = (
                f"{1990 + rng.below(40)}-{1 + rng.below(12):02d}-{1 + rng.below(28):02d} "
                f"{rng.below(24):02d}:{rng.below(60):02d}:{rng.below(60):02d} "
                f"id={rng.below(10**9)} value={rng.below(100000) / 100:.2f} "
                f"{rng.below(256)}.{rng.below(256)}.{rng.below(256)}.{rng.below(256)}"
            )
        elif kind == 5:
            line = "".join(rng.pick(HAN_CHARS) for _ in range(2 + rng.below(20)))
            line += rng.pick(("。", "，", "！", "？", "", "、"))
        elif kind == 6:
            line = f"{rng.pick(WORDS)}: {rng.below(10**6)} / {rng.below(10**4)} = {rng.below(10**8) / 10**4}"
        else:
            line = "#" * rng.below(4) + " " + " ".join(rng.pick(WORDS).title() for _ in range(2 + rng.below(5)))
        lines.append(rng.pick(indents) + line + rng.pick(endings))
    return "".join(lines)


def corpus() -> str:
    # The hand-written text is repeated so its words outweigh the random recombinations.
    return (PROSE + CODE + HAN) * 4 + generated_text(Rng(0x4B33))


def word_counts(text: str) -> list[tuple[bytes, int]]:
    """Pre-tokenized pieces (as in tiktoken) with their counts, sorted so the order is hash-independent."""
    counts = Counter(m.group().encode("utf-8") for m in regex.finditer(PAT_STR, text, flags=regex.V1))
    return sorted(counts.items())


def merge_word(word: list[int], a: int, b: int, new: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(pieces: list[tuple[bytes, int]], num_tokens: int) -> list[bytes]:
    """Byte-level BPE: repeatedly merge the most frequent adjacent pair (ties: smallest ids); tokens by rank."""
    vocab = [bytes([i]) for i in range(256)]
    id_of = {tok: i for i, tok in enumerate(vocab)}
    words = [list(piece) for piece, _ in pieces]
    freqs = [count for _, count in pieces]
    pair_count: dict[tuple[int, int], int] = {}
    pair_words: dict[tuple[int, int], set[int]] = {}
    for w, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            pair_count[pair] = pair_count.get(pair, 0) + freqs[w]
            pair_words.setdefault(pair, set()).add(w)
    heap = [(-count, a, b) for (a, b), count in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < num_tokens:
        if not heap:
            raise SystemExit(f"corpus too small: only {len(vocab)} tokens before pairs ran out")
        neg, a, b = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg or neg == 0:
            continue  # stale heap entry
        merged = vocab[a] + vocab[b]
        # The same bytes can arise from two different pairs; tiktoken ranks bytes, so keep one id.
        new = id_of.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            id_of[merged] = new
        touched: set[tuple[int, int]] = set()
        for w in sorted(pair_words.pop((a, b))):
            old = words[w]
            word = merge_word(old, a, b, new)
            if len(word) == len(old):
                continue
            for pair in zip(old, old[1:], strict=False):
                pair_count[pair] -= freqs[w]
                touched.add(pair)
            for pair in zip(word, word[1:], strict=False):
                pair_count[pair] = pair_count.get(pair, 0) + freqs[w]
                pair_words.setdefault(pair, set()).add(w)
                touched.add(pair)
            words[w] = word
        pair_count.pop((a, b), None)
        for pair in sorted(touched):
            count = pair_count.get(pair, 0)
            if count > 0:
                heapq.heappush(heap, (-count, pair[0], pair[1]))
    return vocab


def tokenizer_config(num_base_tokens: int) -> dict[str, object]:
    decoder = {
        str(num_base_tokens + offset): {"content": name, "special": True} for offset, name in SPECIAL_OFFSETS.items()
    }
    return {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "chat_template": KIMI_CHAT_TEMPLATE,
        "num_special_slots": NUM_SPECIAL_SLOTS,
        "tokenizer_class": "TikTokenTokenizer",
        "built_by": "tools/build_tokenizer.py",
    }


def build(out_dir: Path, num_base_tokens: int = NUM_BASE_TOKENS) -> None:
    """Train on the built-in corpus and write tiktoken.model + tokenizer_config.json into `out_dir`."""
    vocab = train_bpe(word_counts(corpus()), num_base_tokens)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(vocab)]
    (out_dir / MODEL_FILE).write_bytes("".join(lines).encode("ascii"))
    config = json.dumps(tokenizer_config(num_base_tokens), indent=2, ensure_ascii=False) + "\n"
    (out_dir / CONFIG_FILE).write_bytes(config.encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: the package assets)")
    parser.add_argument("--check", action="store_true", help="rebuild into a temp folder and compare with --out")
    args = parser.parse_args(argv)
    if not args.check:
        build(args.out)
        print(f"wrote {args.out / MODEL_FILE} and {args.out / CONFIG_FILE} (N = {NUM_BASE_TOKENS})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        build(Path(tmp))
        stale = [
            name
            for name in (MODEL_FILE, CONFIG_FILE)
            if not (args.out / name).is_file() or (args.out / name).read_bytes() != (Path(tmp) / name).read_bytes()
        ]
    if stale:
        print(f"stale tokenizer assets in {args.out}: {stale}; rerun tools/build_tokenizer.py", file=sys.stderr)
        return 1
    print(f"tokenizer assets in {args.out} match a fresh build")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
