"""Acceptance length tau: speculative greedy decoding with block verification against the target.

Each step drafts a block from the last accepted token (the anchor), runs the target once over
[prefix ; anchor ; draft], accepts the longest draft prefix the target's greedy choice agrees with,
and appends the target's own next token. The output is therefore exactly the target's greedy
decoding; tau is the mean number of tokens produced per target forward (1 <= tau <= block size).
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
    accepted: list[int]  # tokens produced by each verification step


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
    return Generation(tokens, accepted)


def acceptance_length(
    target: Target, drafter: Drafter, prompts: list[torch.Tensor], max_new_tokens: int
) -> tuple[float, list[Generation]]:
    """tau of ``drafter`` over ``prompts`` (tokens produced per verification step, all steps pooled) and
    the generations."""
    was_training = drafter.training
    drafter.eval()
    try:
        generations = [speculative_generate(target, drafter.draft, p.tolist(), max_new_tokens) for p in prompts]
    finally:
        drafter.train(was_training)
    steps = [a for g in generations for a in g.accepted]
    return sum(steps) / len(steps), generations


def show_blocks(generation: Generation, prompt_len: int, decode: Callable[[list[int]], str]) -> str:
    """The generated text with '|' after each verification step's tokens: long runs are accepted drafts."""
    pieces, pos = [], prompt_len + 1  # the first new token comes from the prefill
    for n in generation.accepted:
        pieces.append(decode(generation.tokens[pos : pos + n]))
        pos += n
    return decode(generation.tokens[prompt_len : prompt_len + 1]) + "|".join(pieces)
