"""Acceptance length tau: speculative greedy decoding with block verification against the target.

Each step drafts a block from the last accepted token (the anchor), runs the target once over
[prefix ; anchor ; draft], accepts the longest draft prefix the target's greedy choice agrees with,
and appends the target's own next token. The output is therefore exactly the target's greedy
decoding; tau is the mean number of tokens produced per target forward (1 <= tau <= block size),
reported two ways (``Acceptance``): per prompt and then averaged, as the reference DFlash benchmark
does, and pooled over all steps of all prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import Drafter
from .target import Target

# (features of the context [1, S, F], anchor token) -> proposed tokens after the anchor
Proposer = Callable[[torch.Tensor, int], list[int]]


@dataclass
class Generation:
    tokens: list[int]  # prompt + generated
    accepted: list[int]  # tokens produced by each verification step (the last one cut to the token budget)
    last_cut: bool = False  # whether the token budget cut the last step short


@dataclass
class Acceptance:
    """tau of a drafter over a set of prompts, and what it is made of."""

    per_prompt: float  # each prompt's mean tokens per step, then the mean over prompts (a step the budget cut left out)
    pooled: float  # tokens per step over all steps of all prompts, cut steps included
    histogram: list[float]  # share of the steps that produced k tokens, k = 0 .. block size (k = 0 never happens)
    generations: list[Generation]

    @classmethod
    def of(cls, generations: list[Generation], block_size: int) -> Acceptance:
        steps = [a for g in generations for a in g.accepted]
        whole = [g.accepted[:-1] if g.last_cut else g.accepted for g in generations]
        # Where every prompt's only step was cut (a budget of at most a block), the cut steps are all there is.
        per_prompt = [sum(w) / len(w) for w in whole if w] or [sum(g.accepted) / len(g.accepted) for g in generations]
        histogram = [sum(1 for a in steps if a == k) / len(steps) for k in range(block_size + 1)]
        return cls(sum(per_prompt) / len(per_prompt), sum(steps) / len(steps), histogram, generations)


def speculative_generate(target: Target, propose: Proposer, prompt: list[int], max_new_tokens: int) -> Generation:
    """Greedy speculative decoding of ``max_new_tokens`` tokens after ``prompt``."""
    logits, features = target.logits_and_features(torch.tensor([prompt]), last=1)
    tokens = [*prompt, int(logits[0, -1].argmax())]
    accepted: list[int] = []
    # ``features`` always covers at least every position before the anchor tokens[-1].
    while len(tokens) - len(prompt) < max_new_tokens:
        start = len(tokens) - 1  # position of the anchor: produced by the target, not yet run through it
        draft = propose(features[:, :start], tokens[start])
        block = [tokens[start], *draft]
        logits, features = target.logits_and_features(torch.tensor([tokens[:start] + block]), last=len(block))
        choice = logits[0].argmax(-1).tolist()  # the target's greedy token after each block position
        n = 0
        while n < len(draft) and draft[n] == choice[n]:
            n += 1
        new = [*draft[:n], choice[n]]
        remaining = max_new_tokens - (len(tokens) - len(prompt))
        tokens.extend(new[:remaining])
        accepted.append(min(len(new), remaining))
    return Generation(tokens, accepted, last_cut=bool(accepted) and len(new) > remaining)


def acceptance_length(target: Target, drafter: Drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> Acceptance:
    """tau of ``drafter`` over ``prompts``, with ``max_new_tokens`` tokens generated after each."""
    was_training = drafter.training
    drafter.eval()
    try:
        generations = [speculative_generate(target, drafter.draft, p.tolist(), max_new_tokens) for p in prompts]
    finally:
        drafter.train(was_training)
    return Acceptance.of(generations, drafter.block_size)


def show_blocks(generation: Generation, prompt_len: int, decode: Callable[[list[int]], str]) -> str:
    """The generated text with '|' after each verification step's tokens: long runs are accepted drafts."""
    pieces, pos = [], prompt_len + 1  # the first new token comes from the prefill
    for n in generation.accepted:
        pieces.append(decode(generation.tokens[pos : pos + n]))
        pos += n
    return decode(generation.tokens[prompt_len : prompt_len + 1]) + "|".join(pieces)
