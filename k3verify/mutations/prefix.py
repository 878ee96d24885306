"""Prefix-cache faults: each a way a cache for a hybrid model answers fluently and wrongly."""

from __future__ import annotations

from k3verify.gates.mutation.runner import Mutant

KILLERS = ["serving.prefix.*"]

MUTANTS = [
    Mutant(
        id="serving.prefix.neighbour_block_state",
        fault="a block hit resumes one block before the snapshot's position: the state after the next block is "
              "restored where the prefill starts again",
        target="k3verify.serving.prefix_cache:PrefixCache._hit",
        old="return Hit(entry.end, list(entry.pages), entry.snapshot, matched, reason, entry)",
        new="back = self.block if reason == 'block' else 0\n"
            "        return Hit(entry.end - back, list(entry.pages)[:(entry.end - back) // self.kv.page_size], "
            "entry.snapshot, matched, reason, entry)",
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.conv_window_not_restored",
        fault="a hit restores the KDA recurrent state but not the short-conv windows: they stay those of position 0",
        target="k3verify.serving.prefix_snapshots:restore",
        old="    for name, t in pool.tensors().items():\n        src = snap.tensors[name]",
        new="    for name, t in list(pool.tensors().items())[:1]:\n        src = snap.tensors[name]",
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.whole_entry_ignores_tail",
        fault="a whole-prompt entry is keyed by its full blocks and its length only: a prompt different in a token "
              "inside its last, partial block is served the other prompt's state and logits",
        target="k3verify.serving.prefix_hash:whole_hash",
        old='return _digest(chain[-1] if chain else root, tokens[start:] + [len(tokens)], b"W")',
        new='return _digest(chain[-1] if chain else root, [len(tokens)], b"W")',
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.hash_ignores_parent",
        fault="a block's hash ignores the blocks before it: equal blocks under different prefixes share entries",
        target="k3verify.serving.prefix_hash:block_hashes",
        old='parent = _digest(parent, tokens[start:start + block], b"B")',
        new='parent = _digest(root, tokens[start:start + block], b"B")',
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.evicted_entry_still_found",
        fault="eviction gives an entry's pages back but leaves the entry findable: a later hit reads pages that "
              "another sequence has since written",
        target="k3verify.serving.prefix_cache:PrefixCache._drop",
        old="        del self.entries[e.key]\n",
        new="        e.pins -= 0\n",
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.shared_page_written",
        fault="no copy-on-write: two requests resuming from one whole-prompt entry both write their first decoded "
              "latents into the entry's shared partial page",
        target="k3verify.serving.prefix_pages:SharedLatentCache.copy_on_write",
        old="        if self.refs[page] == 1:\n            return page",
        new="        if self.refs[page] >= 1:\n            return page",
        killers=KILLERS,
    ),
    Mutant(
        id="serving.prefix.outlives_weight_reload",
        fault="the cache's root names the parameters' storage but not their versions: entries made before a weight "
              "is written in place are served after it",
        target="k3verify.serving.prefix_reuse:PrefixReuse.weights_stamp",
        old='h.update(f"{p.data_ptr()}:{p._version};".encode())',
        new='h.update(f"{p.data_ptr()};".encode())',
        killers=KILLERS,
    ),
]
