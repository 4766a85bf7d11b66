"""Generation limits, checked on the prepared batch before any model work: every prompt and the tokens it may
generate must fit the model's positions (`Adapter.max_positions`, the limit `score` and `decide` read too).
The positions are the batch's real next positions (`Adapter.next_positions`): on M-RoPE families an image takes
fewer positions than tokens, so a token count would refuse prompts that fit."""

from __future__ import annotations

from trimvlm.errors import InputError


def check_generation(adapter, prepared, max_new_tokens: int) -> None:
    """Refuse (InputError) a batch whose longest prompt, plus `max_new_tokens`, runs past the model's positions."""
    limit = adapter.max_positions
    if limit is None:
        return
    nxt = [int(n) for n in adapter.next_positions(prepared).tolist()]
    row = max(range(len(nxt)), key=nxt.__getitem__)
    used = nxt[row]
    tokens = int(prepared.attention_mask[row].sum())
    what = f"prompt {row} ({tokens:,} tokens" if len(nxt) > 1 else f"the prompt ({tokens:,} tokens"
    what += ")" if used == tokens else f", {used:,} positions)"
    if used >= limit:
        raise InputError(
            f"{what} exceeds this model's {limit:,} positions (the prompt may take at most {limit - 1:,}, one "
            "left to generate); shorten the prompt"
        )
    if used + max_new_tokens > limit:
        raise InputError(
            f"{what} + max_new_tokens {max_new_tokens:,} exceeds this model's {limit:,} positions; shorten the "
            f"prompt or lower max_new_tokens to at most {limit - used:,}"
        )
