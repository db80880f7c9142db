"""The benchmark workloads, shared by the benchmark scripts.

W1: few-shot classification: a ~1,100-token prompt of 40 labeled reviews, then a new review and a 3-way
choice; 20 calls with different new reviews.
W2: a 6-turn chat whose history grows from ~380 to ~660 tokens, with at most 24 new tokens a turn.
"""
from __future__ import annotations

import random

SUBJECTS = ["The pasta", "Our waiter", "The hotel room", "The concert", "This phone", "The delivery",
            "The coffee", "The museum tour", "The rental car", "The laptop", "The dessert", "The staff"]
GOOD = ["was absolutely wonderful and I would happily come back again next week",
        "exceeded every expectation we had, friendly and fast from start to finish",
        "made our whole evening feel special, thoughtful touches everywhere we looked"]
BAD = ["was cold, late and nobody apologised even after we complained twice",
       "broke after two days and the support line kept us waiting for an hour",
       "was dirty and overpriced, a complete waste of our money and our time"]
MEH = ["was fine, nothing special, about what you would expect for the price",
       "did the job, although some parts were better than others overall",
       "was okay on the whole; I have no strong feelings about it either way"]
LABELS = [("positive", GOOD), ("negative", BAD), ("neutral", MEH)]

W1_QUERY = '''argmax
    "{shots}Review: {review}\\nSentiment:[CLS]"
from "default"
where CLS in [" positive", " negative", " neutral"]
'''

W1_OPTIONS = [" positive", " negative", " neutral"]


def w1_shots(n: int = 40, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = ["Classify the sentiment of each review as positive, negative or neutral.\n\n"]
    for i in range(n):
        label, phrases = LABELS[i % 3]
        lines.append(f"Review: {rng.choice(SUBJECTS)} {rng.choice(phrases)}.\nSentiment: {label}\n\n")
    return "".join(lines)


def w1_reviews(n: int = 20, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(rng.choice(LABELS)[1])}." for _ in range(n)]


W2_SYSTEM = ("You are a friendly travel assistant for a small agency in Lisbon. You answer briefly, in one "
             "or two sentences, and you always suggest one concrete place to visit. The customer is planning "
             "a week-long trip in late spring with two children aged eight and eleven, and prefers walking "
             "and public transport over taxis. They like museums, food markets, beaches and viewpoints, and "
             "they dislike long queues and crowded tourist traps. Their budget is moderate. Keep answers "
             "practical: name the neighbourhood, the best time of day to go, and one tip that saves time. "
             "If a question is unclear, make a sensible assumption and say what you assumed. Never invent "
             "prices or opening hours; say that they should check them on the day instead. Be warm, concise "
             "and specific, and do not repeat advice you have already given in this conversation.")
W2_TURNS = ["Where should we go on our first morning?",
            "And for lunch near there?",
            "Is there a beach we can reach by train?",
            "What about a rainy afternoon?",
            "Which viewpoint is best at sunset?",
            "Any tip for our last evening?"]
W2_ANSWER_TOKENS = 16

W2_QUERY = '''argmax
    "<|im_start|>system\\n{system}<|im_end|>\\n"
    for turn in turns:
        "<|im_start|>user\\n{turn}<|im_end|>\\n<|im_start|>assistant\\n"
        "[ANSWER]" where len(TOKENS(ANSWER)) < ''' + str(W2_ANSWER_TOKENS + 1) + '''
        "<|im_end|>\\n"
from "default"
'''
