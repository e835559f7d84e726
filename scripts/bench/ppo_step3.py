#!/usr/bin/env python3
"""Step 3 end to end on one GPU: seconds per PPO step and its phases, our `ppo` against a PyTorch
reference loop of the same stages, on the same random weights, prompts and sizes, in one run.

The PyTorch side is what a user would write with Hugging Face transformers (DeepSpeed-Chat's
`ppo_trainer.py` without DeepSpeed): the actor and critic trained in fp32 masters under bf16
autocast with fused AdamW and SDPA attention, the frozen reference and reward models in bf16.
Per PPO step, as DS-Chat and our `ppo` do them:
  generate    HF `generate` (greedy, KV cache), the prompts left-padded to --prompt-len;
  experience  the actor's and the reference's log-probs, the critic's values and the reward
              model's score of every sequence; KL-penalised rewards, GAE advantages and returns;
  train       one PPO epoch: the actor's clipped policy loss, backward, clip to norm 1, AdamW;
              the critic's clipped value loss, backward, clip, AdamW.
Our side runs the real `ppo` binary (`--device cuda --dtype bf16`) over the same prompts and reads
its `generate_secs`, `experience_secs` and `training_secs` from metrics.jsonl. The first step of
each side is warm-up; the table gives the median of the others. Device memory: the most
`nvidia-smi` saw in use while each side ran.

Usage: ppo_step3.py --ppo PPO_COMMAND --tokenizer tokenizer.json --work DIR [--actor gpt2-medium]
         [--critic gpt2-medium] [--batch 16] [--prompt-len 256] [--answer-len 256] [--steps 4]
         [--only ours|reference] [--out FILE]
  PPO_COMMAND: how to start our step 3 (for the package: "./run-gpu.sh ppo").
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time

EOS = 50256
VOCAB = 50257
SEED = 1234
# (n_layer, n_embd, n_head): hybrid_engine::Gpt2Config presets.
PRESETS = {"gpt2": (12, 768, 12), "gpt2-medium": (24, 1024, 16), "gpt2-large": (36, 1280, 20), "gpt2-xl": (48, 1600, 25)}
# DS-Chat's step-3 defaults (../shared/RLHF-SPEC.md), also ours.
KL_CTL, CLIP_REWARD, CLIPRANGE, CLIPRANGE_VALUE, GAMMA, LAM = 0.1, 5.0, 0.2, 0.2, 1.0, 0.95
ACTOR_LR, CRITIC_LR = 9.65e-6, 5e-6


def config(size):
    from transformers import GPT2Config

    n_layer, n_embd, n_head = PRESETS[size]
    # No dropout (DS-Chat's step 3 turns the actor's off; the critic's too, here on both sides).
    return GPT2Config(vocab_size=VOCAB, n_positions=1024, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
                      bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)


def write_models(a):
    """Random actor (LM) and reward model (one score) as Hugging Face directories, once."""
    if all(os.path.exists(os.path.join(a.work, name, "model.safetensors")) for name in ("actor", "reward")):
        return
    import torch
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    for name, size, cls in (("actor", a.actor, GPT2LMHeadModel), ("reward", a.critic, GPT2ForSequenceClassification)):
        d = os.path.join(a.work, name)
        torch.manual_seed(SEED)
        cfg = config(size)
        if cls is GPT2ForSequenceClassification:
            cfg.num_labels = 1
        cls(cfg).save_pretrained(d, safe_serialization=True)
        with open(a.tokenizer, "rb") as src, open(os.path.join(d, "tokenizer.json"), "wb") as dst:
            dst.write(src.read())


def write_prompts(a):
    path = os.path.join(a.work, "prompts.jsonl")
    topics = ["rivers", "bread", "violins", "glaciers", "chess", "tides", "bees", "lighthouses"]
    with open(path, "w") as f:
        # Ours holds a tenth of them out for evaluation: enough for `steps` full rollouts.
        for i in range(a.batch * a.steps * 10 // 9 + a.batch):
            prompt = f"\n\nHuman: Tell me about {topics[i % len(topics)]}, and why item {i} matters to them.\n\nAssistant:"
            f.write(json.dumps({"prompt": prompt, "chosen": " Yes.", "rejected": " No."}) + "\n")
    return path


class GpuMemory:
    """The most device memory nvidia-smi reports in use while the block runs, MiB."""

    def __enter__(self):
        self.peak, self.stop = 0.0, threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()
        return self

    def poll(self):
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=5).stdout
                self.peak = max(self.peak, float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                pass
            self.stop.wait(0.25)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def run_ours(a, prompts):
    out = os.path.join(a.work, "ours")
    cmd = shlex.split(a.ppo) + [
        "--data-path", prompts, "--data-split", "0,0,1", "--no-data-cache",
        "--actor-model-name-or-path", os.path.join(a.work, "actor"),
        "--critic-model-name-or-path", os.path.join(a.work, "reward"),
        "--per-device-generation-batch-size", str(a.batch), "--per-device-training-batch-size", str(a.batch),
        "--max-prompt-seq-len", str(a.prompt_len), "--max-answer-seq-len", str(a.answer_len),
        "--actor-dropout", "0", "--critic-dropout", "0",
        "--num-train-epochs", "1", "--device", a.device, "--dtype", a.dtype, "--no-final-checkpoint",
        "--output-dir", out,
    ]
    t0 = time.perf_counter()
    with GpuMemory() as mem:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    if proc.returncode != 0:
        raise SystemExit(f"our ppo failed with exit {proc.returncode}")
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if l.strip()]
    # Full rollouts only (the epoch's last may be partial).
    steps = [r for r in rows if "generate_secs" in r and r["rollout"]["rows"] == a.batch][: a.steps]
    return {
        "impl": "ours",
        "steps": [{"generate": r["generate_secs"], "experience": r["experience_secs"], "train": r["training_secs"],
                   "answer_len": r["rollout"]["answer_len_mean"]} for r in steps],
        "gpu_mib": mem.peak,
        # The plan `ppo` prints before its first rollout, to hold against the measured memory.
        "memory_plan": next((l for l in proc.stdout.splitlines() if l.startswith("step 3 memory plan")), None),
        "process_s": wall,
    }


def logprobs_of(logits, seq):
    """log p(seq[:, t+1] | seq[:, :t+1]) for every t, in f32."""
    import torch
    import torch.nn.functional as F

    return torch.gather(F.log_softmax(logits[:, :-1].float(), dim=-1), 2, seq[:, 1:, None]).squeeze(2)


def values_of(critic, seq, mask, pos):
    hidden = critic.transformer(input_ids=seq, attention_mask=mask, position_ids=pos).last_hidden_state
    return critic.score(hidden).squeeze(-1).float()


def run_reference(a, prompts):
    import torch
    from tokenizers import Tokenizer
    from transformers import GPT2ForSequenceClassification, GPT2LMHeadModel

    dev = torch.device("cuda")
    tok = Tokenizer.from_file(a.tokenizer)
    texts = [json.loads(l)["prompt"] for l in open(prompts)][: a.batch * a.steps]
    ids = [tok.encode(t).ids[-a.prompt_len:] for t in texts]
    load = lambda cls, name: cls.from_pretrained(os.path.join(a.work, name), attn_implementation="sdpa").to(dev)
    actor, critic = load(GPT2LMHeadModel, "actor"), load(GPT2ForSequenceClassification, "reward")
    reference = load(GPT2LMHeadModel, "actor").to(torch.bfloat16).eval()
    reward = load(GPT2ForSequenceClassification, "reward").to(torch.bfloat16).eval()
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=ACTOR_LR, weight_decay=0.0, fused=True)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=CRITIC_LR, weight_decay=0.0, fused=True)
    autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    sync = torch.cuda.synchronize
    p = a.prompt_len
    steps = []
    with GpuMemory() as mem:
        for s in range(a.steps):
            batch = ids[s * a.batch:(s + 1) * a.batch]
            prompt = torch.full((len(batch), p), EOS, dtype=torch.long)
            pmask = torch.zeros_like(prompt)
            for r, row in enumerate(batch):  # left padding, as DS-Chat and ours
                prompt[r, p - len(row):] = torch.tensor(row)
                pmask[r, p - len(row):] = 1
            prompt, pmask = prompt.to(dev), pmask.to(dev)
            sync()
            t0 = time.perf_counter()
            actor.eval()
            with torch.no_grad(), autocast():
                seq = actor.generate(input_ids=prompt, attention_mask=pmask, do_sample=False,
                                     max_new_tokens=a.answer_len, pad_token_id=EOS, use_cache=True)
            sync()
            t1 = time.perf_counter()
            # Experience: the answer's tokens up to and with its first EOS are actions.
            answer = seq[:, p:]
            is_eos = (answer == EOS).int()
            ends = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, torch.full_like(is_eos[:, 0], answer.shape[1]))
            amask = (torch.arange(answer.shape[1], device=dev)[None] < ends[:, None]).long()
            mask = torch.cat([pmask, amask], 1)
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            action = mask[:, 1:].float() * (torch.arange(seq.shape[1] - 1, device=dev)[None] >= p - 1).float()
            with torch.no_grad(), autocast():
                old_lp = logprobs_of(actor(input_ids=seq, attention_mask=mask, position_ids=pos).logits, seq)
                ref_lp = logprobs_of(reference(input_ids=seq, attention_mask=mask, position_ids=pos).logits, seq)
                old_v = values_of(critic, seq, mask, pos)[:, :-1]
                hidden = reward.transformer(input_ids=seq, attention_mask=mask, position_ids=pos).last_hidden_state
                last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
                score = reward.score(hidden[torch.arange(seq.shape[0], device=dev), last]).squeeze(-1).float()
                rewards = -KL_CTL * (old_lp - ref_lp) * action
                last_action = (action.shape[1] - 1 - action.flip(1).argmax(1))
                rewards[torch.arange(seq.shape[0], device=dev), last_action] += score.clamp(-CLIP_REWARD, CLIP_REWARD)
                adv = torch.zeros_like(rewards)
                gae = torch.zeros_like(rewards[:, 0])
                n = rewards.shape[1]
                for t in reversed(range(p - 1, n)):  # GAE over the answer, as DS-Chat's loop
                    nxt = old_v[:, t + 1] * action[:, t + 1] if t + 1 < n else torch.zeros_like(gae)
                    delta = rewards[:, t] + GAMMA * nxt - old_v[:, t]
                    gae = (delta + GAMMA * LAM * gae) * action[:, t]
                    adv[:, t] = gae
                returns = adv + old_v
            sync()
            t2 = time.perf_counter()
            # Train: one PPO epoch, the rollout as one micro-batch per model.
            actor.train()
            with autocast():
                lp = logprobs_of(actor(input_ids=seq, attention_mask=mask, position_ids=pos).logits, seq)
                ratio = torch.exp(lp - old_lp)
                pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - CLIPRANGE, 1 + CLIPRANGE))
                actor_loss = (pg * action).sum() / action.sum()
            actor_loss.backward()
            torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
            actor_opt.step()
            actor_opt.zero_grad(set_to_none=True)
            critic.train()
            with autocast():
                v = values_of(critic, seq, mask, pos)[:, :-1]
                v_clip = old_v + (v - old_v).clamp(-CLIPRANGE_VALUE, CLIPRANGE_VALUE)
                vf = torch.max((v - returns) ** 2, (v_clip - returns) ** 2)
                critic_loss = 0.5 * (vf * action).sum() / action.sum()
            critic_loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            critic_opt.step()
            critic_opt.zero_grad(set_to_none=True)
            sync()
            t3 = time.perf_counter()
            steps.append({"generate": t1 - t0, "experience": t2 - t1, "train": t3 - t2,
                          "answer_len": float(amask.sum(1).float().mean())})
            print(f"reference step {s + 1}: generate {t1 - t0:.2f}s experience {t2 - t1:.2f}s train {t3 - t2:.2f}s "
                  f"answer len {steps[-1]['answer_len']:.1f}", file=sys.stderr)
    return {"impl": "hf-pytorch-sdpa-bf16-fused", "steps": steps, "gpu_mib": mem.peak}


def summary(result):
    measured = result["steps"][1:] or result["steps"]
    med = {k: statistics.median(s[k] for s in measured) for k in ("generate", "experience", "train", "answer_len")}
    med["step"] = med["generate"] + med["experience"] + med["train"]
    return med


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ppo", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--actor", default="gpt2-medium", choices=sorted(PRESETS))
    p.add_argument("--critic", default="gpt2-medium", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--only", choices=["ours", "reference"])
    p.add_argument("--device", default="cuda", help="our side's (cpu: try the script without a GPU, --only ours)")
    p.add_argument("--dtype", default="bf16", help="our side's")
    p.add_argument("--out", help="append the JSON results here")
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    write_models(a)
    prompts = write_prompts(a)
    results = []
    if a.only != "reference":
        results.append(run_ours(a, prompts))
    if a.only != "ours":
        results.append(run_reference(a, prompts))
    label = f"PPO step {a.actor} actor + {a.critic} critic B{a.batch} P{a.prompt_len}+{a.answer_len} {a.dtype}"
    print(f"| Configuration | impl | s/step | generate | experience | train | answer len | GPU MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        m = summary(r)
        print(f"| {label} | {r['impl']} | {m['step']:.2f} | {m['generate']:.2f} | {m['experience']:.2f} | "
              f"{m['train']:.2f} | {m['answer_len']:.1f} | {r['gpu_mib']:.0f} |")
    if len(results) == 2:
        print(f"ours / PyTorch (step time): {summary(results[1])['step'] / summary(results[0])['step']:.2f}x")
    if a.out:
        with open(a.out, "a") as f:
            for r in results:
                f.write(json.dumps({"label": label, **r, "median": summary(r)}) + "\n")


if __name__ == "__main__":
    main()
