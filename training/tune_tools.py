"""Step 3d: tune the chat-tuned target to call tools, to close its thinking and not to loop
(issue 41).

Starts from the shipped target's exported weights (step 4r, dequantized) and cycles four
kinds of step:

  0, 1, 2 (mod 4): answers: 6 tool-use examples (tool_data.py: calls, answers after a tool's
        result, thinking that ends) and 2 chat tasks (chat_data.py), loss on the reply and its
        eos, so the chat tuning of step 3c is kept;
  3, 11 (mod 8): plain likelihood on corpus windows (ordinary completion keeps its perplexity);
  7 (mod 8): sequence-level unlikelihood (tune_target.py's loss) on the model's own greedy text:
        alternately its answers to chat prompts (a chat task's request, or a bare `def` line
        as `generate -p "def fibonacci(n):"` sends it) and its raw continuations of a `def`
        line (`md.generate(pair, "def is_prime(n):")`), UL_TOKENS each.

The first FIRST steps ran an earlier schedule (answers on 0 and 2 mod 4, corpus on 1, unlikelihood
on 3) with tool_data.py's first, smaller name lists (commit a1e4418): at step 150 the model
still wrote training names instead of copying the offered ones, so names became verb-noun
compositions and answers took three steps in four. Constant LR, fixed seeds; checkpoints every CKPT_EVERY steps and resumes. Writes
training/work/target_tuned_hf (then step 4, export_target.py, as before).

    TRAIN_THREADS=1 .venv-train/bin/python training/tune_tools.py --steps 400
"""
import argparse
import copy
import random
from collections import Counter
from pathlib import Path


import agent_data
import chat_data
import tool_data
from common import batch, save_target
from data import WORK
from export_target import load_dequantized
from tune_chat import BATCH, answer_loss, padded, tune, unlikelihood
import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

SEED = 8642
LR = 4e-4
FIRST = 150      # steps run with the first schedule and tool_data.py (commit a1e4418; README)
TOOL_SHARE = 6       # of BATCH answers per step; the rest are chat tasks
UL_BATCH = 4
UL_TOKENS = 80
CKPT_EVERY = 25
CKPT = WORK / "target_tools_ckpt.pt"
OUT = WORK / "target_tuned_hf"


def answers(split, step, n=BATCH):
    return padded([tool_data.example(split, step * n + i) if i < TOOL_SHARE * n // BATCH
                   else chat_data.example(split, 2 * 10**6 + step * n + i) for i in range(n)])


def ul_prompts(step, batch=None):
    """Chat prompts (a task's request or a bare def line) on even cycles, raw def lines on odd."""
    rng = random.Random(f"{SEED}-ul-{step}")
    tok = chat_data.tokenizer()
    pool = chat_data.tasks("train")
    out = []
    for _ in range(UL_BATCH if batch is None else batch):
        name, summary, code = rng.choice(pool)
        first = code.splitlines()[0]
        if (step // (4 if step < FIRST else 8)) % 2:
            out.append(tok.encode(first, add_special_tokens=False))
        else:
            ask = chat_data.ask(name, summary, rng) if rng.random() < 0.6 else first
            out.append(tok.encode(chat_data.render([{"role": "user", "content": ask}], False),
                                  add_special_tokens=False))
    return out


KEEP_PROMPTS, KEEP_TOKENS = 2, 64   # keep_loss per answer step: 2 greedy answers of 64 tokens, about 3 s


def keep_prompts(step, n):
    """keep_loss's (prompt, thought only): chat requests with thinking off and on, raw def lines, and
    requests with tools offered and thinking on, kept only up to the thought's close (the answer
    after it is the agent turns' to learn): the kinds the loop and thinking bars measure."""
    rng = random.Random(f"{SEED}-keep-{step}")
    tok = chat_data.tokenizer()
    out = []
    for _ in range(n):
        name, summary, code = rng.choice(chat_data.tasks("train"))
        kind = rng.choice(["chat", "think", "raw", "tools"])
        if kind == "raw":
            text = code.splitlines()[0]
        elif kind == "tools":
            messages, tools = tool_data.conversation("train", rng)[:2]
            text = tool_data.render(messages, tools, True)
        else:
            ask = [{"role": "user", "content": chat_data.ask(name, summary, rng)}]
            text = chat_data.render(ask, kind == "think")
        out.append((tok.encode(text, add_special_tokens=False), kind == "tools"))
    return out


def thought_end(ids):
    """How many of ``ids`` run through the first ``</think>`` (all of them if none closes)."""
    close = chat_data.tokenizer().encode("</think>", add_special_tokens=False)
    at = chat_data.piece_starts(ids, close)
    return at[0] + len(close) if at else len(ids)


def keep_loss(model, teacher, prompts, max_tokens, on_policy=False, deloop=False):
    """KL(teacher || model) on greedy answers to ``prompts`` ((ids, thought only) pairs): the
    shipped target's answers, which met the loop bars, kept while the agent turns are learnt
    (learning without forgetting, Li and Hoiem 2016). ``on_policy``: on the model's own greedy
    answers instead, so the teacher also corrects the states the model's loops lead to, which its
    own answers never visit (on-policy distillation, Agarwal et al. 2024, "GKD"). ``deloop``
    (on policy): the answers are decoded with third_repeats' tokens barred, and the teacher's
    distribution has the same tokens masked, so where the model would loop its target is the
    teacher's next choice instead of the loop."""
    eos = chat_data.tokenizer().eos_token_id
    total, count = torch.zeros(()), 0
    for p, thought_only in prompts:   # one at a time: no left padding for the recurrent layers
        with torch.no_grad():
            bar = LogitsProcessorList([BarThirdRepeats(len(p))]) if deloop else None
            out = (model if on_policy else teacher).generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                eos_token_id=eos, return_dict_in_generate=True, output_logits=not on_policy,
                logits_processor=bar)
            keep = thought_end(out.sequences[0, len(p):].tolist()) if thought_only else max_tokens
            seq = out.sequences[:, :len(p) + keep]
            # off policy, the logits generate saw: no second forward of the teacher
            logits = teacher(seq[:, :-1]).logits[0, len(p) - 1:] if on_policy else torch.cat(out.logits)[:keep]
            if deloop:
                # finite, so that the barred tokens' 0 * log 0 in the KL below stays 0
                logits = logits.masked_fill(third_repeats(seq[0, len(p):].tolist(), logits.shape[-1])[:len(logits)],
                                            -1e9)
            want = F.log_softmax(logits.float(), -1)
        got = F.log_softmax(model(seq[:, :-1]).logits[0, len(p) - 1:].float(), -1)
        total = total + (want.exp() * (want - got)).sum()
        count += len(want)
    return total / max(count, 1)


def third_repeat_tokens(answer, n=4):
    """The tokens that would make an n-gram's third appearance in ``answer`` if they came next.
    Code often says a 4-gram twice; a third time is how a loop goes on, and two of each is what
    the loop bar's 0.5 share of distinct 4-grams allows."""
    if len(answer) < n - 1:
        return []
    prefix = answer[len(answer) - n + 1:]
    after = Counter(answer[i + n - 1] for i in range(len(answer) - n + 1) if answer[i:i + n - 1] == prefix)
    return [token for token, times in after.items() if times >= 2]


def third_repeats(answer, vocab, n=4):
    """(len(answer) + 1) x vocab: third_repeat_tokens at each position of ``answer``."""
    barred = torch.zeros(len(answer) + 1, vocab, dtype=torch.bool)
    for t in range(len(answer) + 1):
        barred[t, third_repeat_tokens(answer[:t], n)] = True
    return barred


class BarThirdRepeats(LogitsProcessor):
    """Greedy decoding that never picks a third_repeats token (the answer starts at ``start``)."""

    def __init__(self, start):
        self.start = start

    def __call__(self, ids, scores):
        scores[:, third_repeat_tokens(ids[0, self.start:].tolist())] = float("-inf")
        return scores


def kind(step):
    if step < FIRST:
        return {1: "corpus", 3: "ul"}.get(step % 4, "answers")
    return "ul" if step % 8 == 7 else "corpus" if step % 4 == 3 else "answers"


# --hard (the follow-up after 820 steps): each step of 8 is 6 answer steps, 1 corpus, 1 unlikelihood;
# an answer batch holds HARD_SHARE hard calls (tool_data.hard_example: 2-4 randomly named tools of
# different actions), then tool_data.example draws (calls, results, thoughts) and chat tasks; the
# loss on the name of the called function and on the first ARG_TOKENS tokens of each argument is
# weighted by --name-weight (the tokens that must be copied from the tools section and the request).
HARD_SHARE = 4
HARD_TOOL_SHARE = 2
ARG_TOKENS = 3


def hard_kind(step, corpus_every=8, ul_every=8):
    """An unlikelihood step last in every ``ul_every`` (4 or 8), a corpus step at 6 mod
    ``corpus_every`` (4, 8 or 16), answers otherwise."""
    if step % ul_every == ul_every - 1:
        return "ul"
    return "corpus" if step % corpus_every == 6 % corpus_every else "answers"


def copy_weights(reply, weight, first=None):
    """Per reply token: ``weight`` on the called function's name (``first`` on its first token,
    the choice of tool, when given) and on the first ARG_TOKENS tokens of every parameter value,
    1 elsewhere."""
    tok = chat_data.tokenizer()
    lt, fn, eq, gt, nl = (tok.convert_tokens_to_ids(t) for t in ("<", "function", "=", ">", "\n"))
    par = tok.convert_tokens_to_ids("parame")
    w = [1.0] * len(reply)
    i = 0
    while i < len(reply) - 2:
        if reply[i] == lt and reply[i + 1] == fn and reply[i + 2] == eq:
            j = i + 3
            while j < len(reply) and reply[j] != gt:
                w[j] = first if first and j == i + 3 else weight
                j += 1
            i = j
        elif reply[i] == lt and reply[i + 1] == par:
            j = i + 2
            while j < len(reply) and reply[j] != gt:
                j += 1
            j += 2                          # ">" then "\n": the value starts
            for k in range(j, min(j + ARG_TOKENS, len(reply))):
                if reply[k] == nl:
                    break
                w[k] = weight
            i = j
        else:
            i += 1
    return w


def hard_answers(step, weight, n=BATCH, hard=HARD_SHARE, other=HARD_TOOL_SHARE, multi=0, first=None):
    """A padded answer batch: ``multi`` multi-call conversations (tool_data.hard_multi_example),
    ``hard`` hard calls, ``other`` tool_data.example draws, the rest chat tasks; with the
    copy weights (copy_weights) on every labelled token."""
    rows = [tool_data.hard_multi_example("train", step * n + i) for i in range(multi)]
    ex = [tool_data.hard_example("train", step * n + i) for i in range(hard)]
    ex += [tool_data.example("train", 5 * 10**6 + step * n + i) for i in range(other)]
    ex += [chat_data.example("train", 6 * 10**6 + step * n + i) for i in range(n - len(ex) - multi)]
    rows += [(p + a, [-100] * len(p) + a) for p, a in ex]
    width = max(len(i) for i, _ in rows)
    ids = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), -100)
    weights = torch.zeros(labels.shape)
    carry = torch.full((n, width), -100)
    for r, (i, lab) in enumerate(rows):
        ids[r, :len(i)] = torch.tensor(i)
        carry[r, :len(i)] = torch.tensor(carry_targets(i))
        labels[r, :len(lab)] = torch.tensor(lab)
        w = copy_weights(i, weight, first)
        weights[r, :len(i)] = torch.tensor([x if l != -100 else 0.0 for x, l in zip(w, lab)])
    return ids, labels, weights, carry


CARRY_LAYER = 3    # the attention layer: its input is hidden_states[3]
CARRY_SPAN = "function"   # to the tool's </function>, or (--carry-span description) to its </description>


def carry_targets(ids):
    """-100, except from the end of each tool's name in the tools section to its ``</function>``:
    there the name's first token (the auxiliary carry loss: the name, which the template writes
    before the description, carried forward to the tokens that say what the tool does)."""
    tok = chat_data.tokenizer()
    lt, fn, gt, nm, end, des = (tok.convert_tokens_to_ids(t) for t in ("<", "function", ">", "name", "</", "descrip"))
    out = [-100] * len(ids)
    j = 0
    while j < len(ids) - 8:
        if ids[j] == lt and ids[j + 1] == fn and ids[j + 2] == gt and ids[j + 4] == lt and ids[j + 5] == nm:
            first, k = ids[j + 7], j + 8
            while k < len(ids) and ids[k] != end:
                k += 1
            stop = (des,) if CARRY_SPAN == "description" else (fn, gt)
            while k < len(ids) - 2 and not (ids[k] == end and tuple(ids[k + 1:k + 1 + len(stop)]) == stop):
                out[k] = first
                k += 1
            j = k
        else:
            j += 1
    return out


def lens(model, h):
    """Logits read from a residual ``h`` through the final norm and lm_head, both held fixed."""
    norm = model.model.norm_f
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.detach()
    return F.linear(h, model.lm_head.weight.detach()).float()


def attention_to_tool(model):
    """Keeps the attention layer's probabilities of the next forward (eager attention) in the
    returned list, for the attend loss."""
    model.config._attn_implementation = "eager"
    kept = []
    model.model.layers[CARRY_LAYER].mixer.register_forward_hook(lambda m, i, o: kept.append(o[1]))
    return kept


def attend_loss(probs, carry, labels, chosen):
    """-log of the attention mass (mean over heads) that each position choosing a tool (``chosen``)
    puts on the right tool's span in the tools section (carry_targets: the tokens after its name
    carry the name's first token, which is the label there)."""
    rows, qs = chosen.nonzero(as_tuple=True)
    right = carry[rows] == labels[rows, qs][:, None]                  # (n, keys)
    mass = (probs[rows, :, qs, :] * right[:, None, :]).sum(-1).mean(-1)
    return -torch.log(mass.clamp_min(1e-6)).mean(), mass.mean().item()


def weighted_answer_loss(model, ids, labels, weights, carry=None, carry_weight=0.0, log=None,
                         select_weight=0.0, first=None, attend=None, attend_weight=0.0):
    if attend is not None:
        attend.clear()
    out = model(ids[:, :-1], output_hidden_states=carry_weight > 0 or select_weight > 0)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="none")
    w = weights[:, 1:].flatten()
    loss = (ce * w).sum() / w.sum()
    if carry_weight > 0:
        mask = carry[:, :-1] != -100
        aux_logits = lens(model, out.hidden_states[CARRY_LAYER][mask])
        aux = F.cross_entropy(aux_logits, carry[:, :-1][mask])
        if log is not None:
            log.append((aux.item(), (aux_logits.argmax(-1) == carry[:, :-1][mask]).float().mean().item()))
        loss = loss + carry_weight * aux
    if select_weight > 0:   # the attention layer's output must already name the tool
        mask = weights[:, 1:] == first
        sel = F.cross_entropy(lens(model, out.hidden_states[CARRY_LAYER + 1][mask]), labels[:, 1:][mask])
        if log is not None:
            log.append((sel.item(), -1.0))
        loss = loss + select_weight * sel
    if attend_weight > 0:   # the attention layer must look at the right tool's description
        att, mass = attend_loss(attend[-1], carry[:, :-1], labels[:, 1:], weights[:, 1:] == first)
        if log is not None:
            log.append((att.item(), mass))
        loss = loss + attend_weight * att
    return loss


def keep_attention_inputs(model, kept):
    """Appends each forward's input to the attention layer to ``kept``; returns the hook's handle."""
    return model.model.layers[CARRY_LAYER].mixer.register_forward_pre_hook(
        lambda m, args, kw: kept.append(args[0] if args else kw["hidden_states"]), with_kwargs=True)


def agent_loss(model, step, rows, weight=1.0, attend_weight=0.0, log=None, copy_weight=0.0, readout_weight=0.0):
    """The answer loss on ``rows`` agent turns (agent_data.example; half Codex, half opencode,
    three calls to one answer), the called name and the arguments' first tokens weighted by
    ``weight`` (copy_weights). An agent's turns in a step share its folder, so their prompts
    agree up to the user's request (9,000 of 9,000-10,000 tokens): that prefix runs once, without
    gradient, and each turn's rest continues from a copy of its cache. The loss is the one the
    whole forward gives (logits within 2e-5 of it); the gradient stops at the prefix, whose labels
    are all -100 anyway, and a turn costs 0.2 s instead of 4.4. With ``attend_weight``, plus
    last_turn_loss on the calls' argument tokens; with ``copy_weight``, plus copy_loss on them;
    with ``readout_weight``, plus copy_readout_loss on them."""
    losses = []
    for agent in range(2):
        group = [agent_data.example("train", step * rows + 2 * i + agent, agent_data.folder(f"step-{step}"),
                                    "result" if i % 4 == 3 else "call") for i in range(rows // 2)]
        n = agent_data.shared_prefix([p for p, _ in group])
        kept = []
        hook = keep_attention_inputs(model, kept) if attend_weight or copy_weight or readout_weight else None
        said = []
        out_hook = model.model.layers[CARRY_LAYER].register_forward_hook(
            lambda m, args, out: said.append(out[0] if isinstance(out, tuple) else out)) if readout_weight else None
        with torch.no_grad():
            cache = model(torch.tensor([group[0][0][:n]]), use_cache=True).past_key_values
        for prompt, reply in group:
            rest = prompt[n:] + reply
            labels = torch.tensor([-100] * (len(prompt) - n) + reply)
            weights = torch.tensor([0.0] * (len(prompt) - n) + copy_weights(reply, weight))
            logits = model(torch.tensor([rest[:-1]]), past_key_values=copy.deepcopy(cache),
                           use_cache=True).logits[0].float()
            ce = F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="none")
            loss = (ce * weights[1:]).sum() / weights[1:].sum()
            where = value_positions(reply)
            queries = [len(prompt) + j - 1 for j in where]
            if hook is not None and queries:
                h = torch.cat([kept[0][0], kept[-1][0]])
                start = agent_data.last_turn_start(prompt)
                if attend_weight:
                    att, mass = last_turn_loss(model, h, prompt, queries, start)
                    loss = loss + attend_weight * att
                    if log is not None:
                        log.append(round(mass, 3))
                values = [reply[j] for j in where]
                sources = copy_sources(prompt, start, values)
                if copy_weight:
                    loss = loss + copy_weight * copy_loss(model, h, queries, sources)
                if readout_weight:   # the rest's positions: the prefix's n tokens come first
                    loss = loss + readout_weight * copy_readout_loss(
                        model, said[-1][0], [q - n for q in queries], sources, values)
            del kept[1:], said[:]
            losses.append(loss)
        for handle in (hook, out_hook):
            if handle is not None:
                handle.remove()
    return sum(losses) / len(losses)


def value_positions(reply):
    """Indices in ``reply`` of the tokens of every parameter value of its calls."""
    tok = chat_data.tokenizer()
    lt, par, gt, nl, close = (tok.convert_tokens_to_ids(t) for t in ("<", "parame", ">", "\n", "</"))
    out, i = [], 0
    while i < len(reply) - 1:
        if reply[i] == lt and reply[i + 1] == par:
            j = reply.index(gt, i) + 2                  # ">" then "\n": the value starts
            while j < len(reply) - 1 and not (reply[j] == nl and reply[j + 1] == close):
                out.append(j)
                j += 1
            i = j
        else:
            i += 1
    return out


def attention_probs(model, h, queries):
    """The attention layer's probabilities (heads, len(queries), len(h)) at ``queries``. ``h``:
    that layer's input; its queries and keys recomputed (no positions: Nemotron-H's attention
    has none)."""
    attn = model.model.layers[CARRY_LAYER].mixer
    n, d = attn.config.num_attention_heads, attn.head_dim
    q = attn.q_proj(h[queries]).view(len(queries), n, d)                  # (Q, heads, d)
    k = attn.k_proj(h).view(h.shape[0], -1, d).repeat_interleave(attn.num_key_value_groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * attn.scaling
    causal = torch.arange(h.shape[0])[None, :] > torch.tensor(queries)[:, None]
    return scores.masked_fill(causal, float("-inf")).softmax(-1)


def last_turn_loss(model, h, prompt, queries, start):
    """-log of the attention mass (mean over heads) that the attention layer puts, at each of
    ``queries``, on the prompt's last turn (from ``start`` on): where the user named the command
    or file, 9,000 tokens after instructions full of other commands."""
    mass = attention_probs(model, h, queries)[:, :, start:len(prompt)].sum(-1).mean(0)   # (Q,)
    return -torch.log(mass.clamp_min(1e-6)).mean(), mass.mean().item()


def copy_sources(prompt, start, values):
    """For each argument token, the positions of the last turn holding the same piece, a leading
    space aside: a name's first piece is ``▁set`` in "What does setup.py" and ``set`` in a call
    that opens the value with it, and that first piece is the one the tunes got wrong
    (training/README.md, step 3d, session 17)."""
    pieces = chat_data.tokenizer().convert_ids_to_tokens
    bare = [p.lstrip("▁") for p in pieces(prompt[start:])]
    return [[start + i for i, b in enumerate(bare) if b and b == v.lstrip("▁")] for v in pieces(values)]


def copy_loss(model, h, queries, sources):
    """-log of the attention mass the best head puts, where an argument token is predicted, on
    the request's copies of that token (copy_sources): the copy spelled out for the one attention
    layer, which last_turn_loss only points at the request. The best head alone, so the other
    heads keep their work. Tokens the request does not hold (``cat``, ``ls``) add nothing."""
    kept = [(i, s) for i, s in enumerate(sources) if s]
    if not kept:
        return torch.zeros(())
    probs = attention_probs(model, h, [queries[i] for i, _ in kept])
    mass = torch.stack([probs[:, j, s].sum(-1) for j, (_, s) in enumerate(kept)], 1)   # (heads, Q)
    return -torch.log(mass.max(0).values.clamp_min(1e-6)).mean()


def copy_readout_loss(model, said, queries, sources, values):
    """Cross-entropy of the argument tokens the request holds (``sources`` non-empty), read
    through the final norm and lm_head (lens) from the residual right after the attention
    layer (``said``, the turn's rest; ``queries`` index it): the copied piece must already be
    there, written by the attention layer's values from the request's piece (``▁set`` to
    ``set``), not left to the two layers after it."""
    kept = [i for i, s in enumerate(sources) if s]
    if not kept:
        return torch.zeros(())
    return F.cross_entropy(lens(model, said[[queries[i] for i in kept]]), torch.tensor([values[i] for i in kept]))


def agent_probe(model, n=4) -> str:
    """Teacher-forced on ``n`` held-out agent turns (calls and answers, both agents): the
    share of reply tokens the model's argmax gets right, and of whole replies."""
    right = whole = total = 0
    with torch.no_grad():
        for i in range(n):
            ids, labels = padded([agent_data.example("heldout", i)])
            hit = model(ids[:, :-1]).logits.argmax(-1) == labels[:, 1:]
            mask = labels[:, 1:] != -100
            right += (hit & mask).sum().item()
            total += mask.sum().item()
            whole += bool(hit[mask].all())
    return f"agent tokens {right}/{total}, whole replies {whole}/{n}"


def main(model=None):
    """``model``: tune this one instead of the shipped target's exported weights."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--random-names", action="store_true",
                    help="generated tools get meaningless names (tool_data.RANDOM_NAMES)")
    ap.add_argument("--hard", action="store_true", help="the hard-call schedule (above)")
    ap.add_argument("--name-weight", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=LR)
    ap.add_argument("--ckpt", default=str(CKPT))
    ap.add_argument("--init", help="a checkpoint to start --ckpt from (weights and optimizer; step 0), "
                                   "or an export folder (its weights, a fresh optimizer)")
    ap.add_argument("--probe-every", type=int, default=25)
    ap.add_argument("--hard-share", type=int, default=HARD_SHARE, help="hard calls per answer batch")
    ap.add_argument("--multi-share", type=int, default=0, help="multi-call conversations per answer batch")
    ap.add_argument("--first-weight", type=float, help="loss weight of the name's first token")
    ap.add_argument("--two-tools", action="store_true", help="hard sets of 2 tools only")
    ap.add_argument("--carry-weight", type=float, default=0.0,
                    help="weight of the auxiliary carry loss (carry_targets) on the attention layer's input")
    ap.add_argument("--vocab-names", action="store_true", help="tool_data.VOCAB_NAMES")
    ap.add_argument("--select-weight", type=float, default=0.0,
                    help="weight of the auxiliary loss naming the tool from the attention layer's output")
    ap.add_argument("--attend-weight", type=float, default=0.0,
                    help="weight of the auxiliary loss on the attention layer's mass on the right tool")
    ap.add_argument("--carry-span", default="function", choices=["function", "description"])
    ap.add_argument("--kinds", type=float, nargs=3, help="tool_data.example's call/result/think weights")
    ap.add_argument("--corpus-every", type=int, default=8, help="a corpus step every n (4, 8 or 16)")
    ap.add_argument("--ul-every", type=int, default=8, help="an unlikelihood step every n (4 or 8)")
    ap.add_argument("--ul-batch", type=int, default=UL_BATCH, help="prompts per unlikelihood step")
    ap.add_argument("--ul-tokens", type=int, default=UL_TOKENS, help="greedy tokens each unlikelihood prompt runs")
    ap.add_argument("--def-lines", type=float, default=0.0,
                    help="share of chat tasks asked by the function's first line alone (chat_data.DEF_LINE_SHARE)")
    ap.add_argument("--chat-thoughts", choices=["summary", "short"], default="",
                    help="thinking-on rows write a thought first: the task's summary, or short fixed "
                         "sentences (chat_data.THOUGHTS)")
    ap.add_argument("--think-share", type=float, default=chat_data.THINK_SHARE,
                    help="share of chat tasks with thinking on (chat_data.THINK_SHARE)")
    ap.add_argument("--keep-every", type=int, default=0, help="keep every n-th step's checkpoint too")
    ap.add_argument("--qat", action="store_true",
                    help="every forward sees the weights as step 4 exports them (nvfp4_qat.py)")
    ap.add_argument("--agent-rows", type=int, default=0,
                    help="agent turns (agent_data.py) added to each answer step, with --agent-weight")
    ap.add_argument("--agent-weight", type=float, default=1.0)
    ap.add_argument("--agent-attend", type=float, default=0.0,
                    help="weight of last_turn_loss on the agent calls' argument tokens")
    ap.add_argument("--agent-copy", type=float, default=0.0,
                    help="weight of copy_loss on the agent calls' argument tokens")
    ap.add_argument("--agent-readout", type=float, default=0.0,
                    help="weight of copy_readout_loss on the agent calls' argument tokens")
    ap.add_argument("--keep-weight", type=float, default=0.0,
                    help="weight of keep_loss: the shipped target's greedy answers (work/target_nvfp4_shipped, step 4r) kept")
    ap.add_argument("--keep-kinds", action="store_true",
                    help="keep_loss on keep_prompts (thinking on, tools offered too), not ul_prompts")
    ap.add_argument("--keep-on-policy", action="store_true",
                    help="keep_loss on the tuned model's own greedy answers, not the shipped target's")
    ap.add_argument("--mirror-names", action="store_true",
                    help="agent calls spell a named file in the request's pieces (agent_data.mirrored)")
    ap.add_argument("--made-up-files", type=float, default=0.0,
                    help="share of agent turns naming made-up files (agent_data.MADE_UP_FILES)")
    ap.add_argument("--tool-share", type=int, default=HARD_TOOL_SHARE,
                    help="tool_data.example draws per answer batch (the rest: chat tasks)")
    args = ap.parse_args()
    tool_data.RANDOM_NAMES = args.random_names
    agent_data.MADE_UP_FILES = args.made_up_files
    agent_data.MIRROR_NAMES = args.mirror_names
    ckpt = Path(args.ckpt)
    if args.init and not ckpt.exists():
        # an export (4r's target_nvfp4_shipped: the shipped target) or a --keep-every checkpoint
        # (weights only) starts a fresh optimizer; a run's checkpoint brings its own
        ck = {} if Path(args.init).is_dir() else torch.load(args.init)
        if "opt" not in ck:
            start = load_dequantized(Path(args.init)) if Path(args.init).is_dir() else load_dequantized()
            if ck:
                start.load_state_dict(ck["model"])
            ck = {"model": start.state_dict(), "opt": torch.optim.AdamW(
                start.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0).state_dict()}
        torch.save({**ck, "step": 0}, ckpt)
    teacher = load_dequantized(WORK / "target_nvfp4_shipped").eval() if args.keep_weight else None
    if args.hard:
        import tool_probe
        probes = tool_probe.heldout_examples(), tool_probe.generated_examples(50)   # 2-4 tools
        if args.two_tools:
            tool_data.HARD_SIZES = [2]
        tool_data.VOCAB_NAMES = args.vocab_names
        chat_data.DEF_LINE_SHARE = args.def_lines
        chat_data.THOUGHTS = args.chat_thoughts
        chat_data.THINK_SHARE = args.think_share
        global CARRY_SPAN
        CARRY_SPAN = args.carry_span
        if args.kinds:
            tool_data.KIND_WEIGHTS = args.kinds

        carry_log = []
        attend = []

        def step_loss(model, stream, step):
            if args.attend_weight and not attend:
                attend.append(attention_to_tool(model))
            if step % args.probe_every == 0:
                print(f"probe step {step}: {tool_probe.report(model, probes)}", flush=True)
                if args.agent_rows:
                    print(f"probe step {step}: {agent_probe(model)}", flush=True)
            k = hard_kind(step, args.corpus_every, args.ul_every)
            if k == "ul":
                return unlikelihood(model, ul_prompts(step + 1, args.ul_batch), args.ul_tokens)   # ul_prompts alternates by step // 8
            if k == "corpus":
                x = batch(stream, 10**5 + step, BATCH, SEED)
                return model(x[:, :-1], labels=x[:, :-1].clone()).loss, None
            loss = weighted_answer_loss(model, *hard_answers(
                step, args.name_weight, BATCH, args.hard_share, args.tool_share, args.multi_share,
                args.first_weight), args.carry_weight, carry_log, args.select_weight, args.first_weight,
                attend[0] if attend else None, args.attend_weight)
            if args.keep_weight:
                kept = keep_prompts(step, KEEP_PROMPTS) if args.keep_kinds else \
                    [(p, False) for p in ul_prompts(step, KEEP_PROMPTS)]
                loss = loss + args.keep_weight * keep_loss(model, teacher, kept, KEEP_TOKENS, args.keep_on_policy)
            if args.agent_rows:
                loss = loss + args.agent_weight * agent_loss(model, step, args.agent_rows, args.name_weight,
                                                             args.agent_attend, carry_log, args.agent_copy,
                                                             args.agent_readout)
            if carry_log and step % 20 == 0:
                print(f"step {step} carry/select/attend losses {carry_log[-3:]}", flush=True)
            return loss, None

        model = tune(args.steps, SEED, ckpt, step_loss, lambda: answers("heldout", 0, 16), args.lr, CKPT_EVERY,
                     model, args.qat, args.keep_every)
        save_target(model, OUT, {"hard_steps": args.steps, "init": args.init, "lr": args.lr,
                                 "name_weight": args.name_weight, "batch": BATCH, "hard_share": args.hard_share,
                                 "tool_share": args.tool_share, "random_names": args.random_names,
                                 "multi_share": args.multi_share, "first_weight": args.first_weight,
                                 "corpus_every": args.corpus_every, "two_tools": args.two_tools, "kinds": args.kinds, "carry_weight": args.carry_weight, "carry_span": args.carry_span, "vocab_names": args.vocab_names, "select_weight": args.select_weight, "attend_weight": args.attend_weight, "def_lines": args.def_lines, "ul_every": args.ul_every, "ul_tokens": args.ul_tokens, "qat": args.qat, "chat_thoughts": args.chat_thoughts, "agent_rows": args.agent_rows, "agent_weight": args.agent_weight, "agent_attend": args.agent_attend, "agent_copy": args.agent_copy, "agent_readout": args.agent_readout, "mirror_names": args.mirror_names, "keep_weight": args.keep_weight, "keep_on_policy": args.keep_on_policy, "keep_kinds": args.keep_kinds, "made_up_files": args.made_up_files})
        return

    def step_loss(model, stream, step):
        if kind(step) == "ul":
            return unlikelihood(model, ul_prompts(step), UL_TOKENS)
        if kind(step) == "corpus":
            x = batch(stream, step, BATCH, SEED)
            return model(x[:, :-1], labels=x[:, :-1].clone()).loss, None
        return answer_loss(model, *answers("train", step)), None

    model = tune(args.steps, SEED, CKPT, step_loss, lambda: answers("heldout", 0, 16), LR, CKPT_EVERY, model)
    save_target(model, OUT, {"tool_tune_steps": args.steps, "lr": LR, "batch": BATCH,
                             "tool_share": TOOL_SHARE, "ul_batch": UL_BATCH, "ul_tokens": UL_TOKENS,
                             "heldout_answer_loss": answer_loss(model.eval(), *answers("heldout", 0, 16)).item()})


if __name__ == "__main__":
    main()
