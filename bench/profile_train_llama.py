"""GPU kernel time and wall time of a Hugging Face Llama training step under transfuse: 8 layers of
TinyLlama-1.1B's width (2048 hidden, 32 heads, 4 KV heads, 5632 MLP), batch 4 x 1024, bf16 autocast,
fused AdamW, random weights. Dev tool:

    PYTHONPATH=src python3 bench/profile_train_llama.py [transfuse|compile|eager] [rows]

build() and make_step() are shared with bench/train_llama_vs_compile.py (a sibling script)."""
import sys

import torch
import transformers

import transfuse
from profile_train import profile_steps  # a sibling script (bench/ is on sys.path)


def build() -> tuple[torch.nn.Module, torch.Tensor]:
    """(the model in train mode on the GPU, the (4, 1024) token ids it trains on), seed 0."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                   num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                   max_position_embeddings=2048)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).cuda().train()
    model.loss_type = "ForCausalLM"
    return model, torch.randint(0, 32000, (4, 1024), device="cuda")


def make_step(model: torch.nn.Module, run, ids: torch.Tensor, with_mask: bool = False):
    """One optimizer step of `run` (the model, or what a compiler made of it) on ids (and an
    attention_mask of ones, as a data collator passes, when with_mask); returns the loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    extra = {"attention_mask": torch.ones_like(ids)} if with_mask else {}

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids, **extra).loss
        loss.backward()
        opt.step()
        return loss

    return step


def main() -> None:
    provider = sys.argv[1] if len(sys.argv) > 1 else "transfuse"
    rows = int(sys.argv[2]) if len(sys.argv) > 2 else 12
    model, ids = build()
    run = torch.compile(model) if provider == "compile" else transfuse.optimize(model) if provider == "transfuse" else model
    step = make_step(model, run, ids)
    prof, per_step_ms = profile_steps(step, warmup=3, steps=3)
    print(f"{provider}: kernel time per step {per_step_ms:.2f} ms")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        step()
    end.record()
    torch.cuda.synchronize()
    print(f"wall per step {start.elapsed_time(end) / 5:.2f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
