"""The benchmark workloads, shared by the benchmark scripts.

W1: few-shot classification: a ~1,100-token prompt of 40 labeled reviews, then a new review and a 3-way
choice; 20 calls with different new reviews.
W2: a 6-turn chat whose history grows from ~380 to ~660 tokens, with at most 24 new tokens a turn.
W3: self-consistency: W1's prompt sampled 8 times a call (`sample(n=8)`), a label and a short reason each.
"""
from __future__ import annotations

import copy
import os
import platform
import random
import statistics
from pathlib import Path

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

def cpu_host() -> str:
    """The CPU a benchmark ran on, as its header names it: model, CPU count, the instruction set and the target
    lmq's kernels were built for (`LMQ_CPU_MARCH`: another than the host's own is measured as that target)."""
    from lmq_kernels import cpu

    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    except OSError:
        model = platform.processor()
    return f"{model}, {os.cpu_count()} CPUs, ISA {cpu.isa()} (-march={cpu.target()})"


W1_QUERY = '''argmax
    "{shots}Review: {review}\\nSentiment:[CLS]"
from "default"
where CLS in [" positive", " negative", " neutral"]
'''

W1_OPTIONS = [" positive", " negative", " neutral"]

W3_SAMPLES = 8
W3_REASON_TOKENS = 12
W3_QUERY = f'''sample(n={W3_SAMPLES}, temperature=0.8)
    "{{shots}}Review: {{review}}\\nSentiment:[CLS], because[WHY]"
from "default"
where CLS in [" positive", " negative", " neutral"] and len(TOKENS(WHY)) <= {W3_REASON_TOKENS}
'''


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


# Varied calls (bench_concurrency --workload varied / mix): reviews that differ in length and wording, and a mix of
# templates with prefixes of their own, as a server's traffic has (not one text with a counter).
DETAILS = ["on a rainy Tuesday", "after a long flight", "with my two kids", "for our anniversary",
           "during the holiday rush", "on the first day", "at about nine in the evening", "with a group of eight",
           "despite the booking mix-up", "after reading the other reviews", "on a business trip", "in the end"]
CONNECTORS = [" Also, ", " On the other hand, ", " To be fair, ", " Then ", " Honestly, ", " Later "]


def varied_reviews(n: int, seed: int = 0) -> list[str]:
    """n reviews of one to five sentences (about 12 to 110 tokens), each its own subjects, verdicts, details and
    a number, so no two calls share more than a few words in a row."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        parts = []
        for k in range(rng.choice([1, 1, 2, 2, 3, 4, 5])):
            subject = rng.choice(SUBJECTS)
            sentence = f"{subject if k == 0 else subject.lower()} {rng.choice(rng.choice(LABELS)[1])}"
            if rng.random() < 0.6:
                sentence += f" {rng.choice(DETAILS)}"
            parts.append(sentence + ".")
        text = parts[0] + "".join(rng.choice(CONNECTORS) + p for p in parts[1:])
        out.append(f"{text} ({rng.randint(1, 5)} stars, order {rng.randint(100, 99999)})")
    return out


SUPPORT_SYSTEM = ("You are the customer support assistant of an online shop that sells kitchen appliances, "
                  "phones and laptops. Answer in one short sentence. Be polite, never promise refunds, and point "
                  "the customer to the returns page when something arrived broken. Ask for the order number when "
                  "it is missing, and thank the customer for their patience when a delivery was late.\n\n")
TRANSLATIONS = [("The delivery was late.", "La livraison était en retard."),
                ("The coffee was excellent.", "Le café était excellent."),
                ("Our waiter was very friendly.", "Notre serveur était très aimable."),
                ("The hotel room was dirty.", "La chambre d'hôtel était sale."),
                ("The concert was fine, nothing special.", "Le concert était correct, sans plus."),
                ("This phone broke after two days.", "Ce téléphone est tombé en panne après deux jours.")]
# (name, the query's one line: a prefix, the call's review, a hole S)
MIX_TEMPLATES = [("summary", '"{prefix}Review: {review}\\nSummary:[S]"'),
                 ("support", '"{prefix}Customer: {review}\\nAssistant:[S]"'),
                 ("classify", '"{prefix}Review: {review}\\nSentiment:[S]"'),
                 ("translate", '"{prefix}English: {review}\\nFrench:[S]"')]


def mix_prefixes() -> list[str]:
    """The prefixes of `MIX_TEMPLATES`, in order: W1's shots, a support system prompt, other shots, translations."""
    translate = "Translate each customer review into French.\n\n" + "".join(
        f"English: {en}\nFrench: {fr}\n\n" for en, fr in TRANSLATIONS * 3)
    return [w1_shots(40, seed=1), SUPPORT_SYSTEM, w1_shots(30, seed=2), translate]


def mix_calls(n: int, seed: int = 0) -> list[tuple[int, dict]]:
    """n calls of the template mix: (template index, inputs), the template drawn at random per call, every review
    from `varied_reviews`."""
    rng = random.Random(seed)
    prefixes = mix_prefixes()
    return [(t, {"prefix": prefixes[t], "review": text})
            for text in varied_reviews(n, seed=seed + 1) for t in [rng.randrange(len(MIX_TEMPLATES))]]


W2_SYSTEM = ("You are a friendly travel assistant for a small agency in Lisbon. You answer briefly, in one "
             "or two sentences, and you always suggest one concrete place to visit. The customer is planning "
             "a week-long trip in late spring with two children aged eight and eleven, and prefers walking "
             "and public transport over taxis. They like museums, food markets, beaches and viewpoints, and "
             "they dislike long queues and crowded tourist traps. Their budget is moderate. Keep answers "
             "practical: name the neighbourhood, the best time of day to go, and one tip that saves time. "
             "If a question is unclear, make a sensible assumption and say what you assumed. Never invent "
             "prices or opening hours; say that they should check them on the day instead. Be warm, concise "
             "and specific, and do not repeat advice you have already given in this conversation.\n\n"
             "About the family: they arrive on a Saturday morning flight and stay in a rented flat in Graça, "
             "near the tram 28 stop. The younger child gets tired after long walks and loves trams, boats and "
             "anything with animals; the older one is interested in history, castles and science. One parent "
             "does not eat meat, so always mention a vegetarian option when you suggest food. They have a "
             "Navegante card for buses, trams, the metro and suburban trains, and they are happy to take the "
             "ferry across the river. They would like one day trip outside the city, probably to Sintra or "
             "Cascais, and one slow day with no plans at all. They are early risers and like to be back at the "
             "flat by nine in the evening. When you mention a place, give its neighbourhood or town, how to get "
             "there from Graça by public transport, and whether it suits children of their ages.")
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


# W2 with role tags: the model's own chat template writes the markup (for SmolLM2, the same text as W2_QUERY's)
W2_ROLES_QUERY = '''argmax
    "{:system} {system}"
    for turn in turns:
        "{:user} {turn}"
        "{:assistant} [ANSWER]" where len(TOKENS(ANSWER)) < ''' + str(W2_ANSWER_TOKENS + 1) + '''
from "default"
'''


def random_config(shape: str):
    """Configs of the random-weight models used on the GPU (speed does not depend on weight values)."""
    from transformers import LlamaConfig

    if shape == "smollm2-135m":
        return LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                           rope_theta=100000.0, max_position_embeddings=8192, rms_norm_eps=1e-5)
    if shape == "llama-1b":
        return LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                           rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
                           rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    raise ValueError(f"unknown shape {shape!r}: smollm2-135m or llama-1b")


def plain_model(model):
    """The baselines' model: a copy of the served model as transformers itself runs it. lmq re-lays out the
    weights of a model it serves on the CPU (K-major, for its fused decode step) and routes its attention
    through lmq's function; the baselines must not get either."""
    import torch

    plain = copy.deepcopy(model)
    with torch.no_grad():
        for p in plain.parameters():
            p.data = p.data.contiguous()
    plain.set_attn_implementation("sdpa")
    return plain.eval()


def until_calibrated(run, quiet: int = 2, most: int = 12) -> int:
    """Call `run()` until `quiet` calls in a row measure no new class of lmq's CPU kernels
    (`lmq_kernels.cpu.choices()`: the classes measured or loaded so far), at most `most` times; returns the
    calls made. A benchmark's warm-up: on a machine's first run, concurrent calls meet their batch sizes (the
    kernels' row classes) a few at a time, and one or two warm-up runs left measurements inside the timed
    rounds. On a GPU, `quiet` calls."""
    from lmq_kernels import cpu

    still = 0
    for calls in range(1, most + 1):
        before = len(cpu.choices())
        run()
        still = still + 1 if len(cpu.choices()) == before else 0
        if still >= quiet:
            return calls
    return most


def copy_bandwidth(device="cuda") -> float | None:
    """Bytes read + written per second by a 1 GiB device-to-device copy on `device` (the median of 20 copies): the
    memory floor the GPU benchmarks divide by, measured in the same run. None on a CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    src, dst = (torch.empty(1 << 29, dtype=torch.bfloat16, device=device) for _ in range(2))
    dst.copy_(src)
    times = []
    for _ in range(20):
        started, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started.record()
        dst.copy_(src)
        ended.record()
        ended.synchronize()
        times.append(started.elapsed_time(ended))
    return 2 * (1 << 30) / (statistics.median(times) * 1e-3)
