"""The checkpoint names the weights.* checks edit in (drop, add): the same three for the strict loader and the
reconcile buckets, so both checks judge one set of edits."""

UNKNOWN_IN_PREFIX = "model.layers.0.self_attn.unknown_proj.weight"  # under the text-model prefix, no parameter
UNKNOWN_OUTSIDE = "audio_tower.proj.weight"  # outside the prefix and not declared ignorable
DROPPED = "model.norm.weight"
