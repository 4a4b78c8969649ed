"""GPU kernel time and wall time of a Hugging Face Llama training step under transfuse: 8 layers of
TinyLlama-1.1B's width (2048 hidden, 32 heads, 4 KV heads, 5632 MLP), batch 4 x 1024, bf16 autocast,
fused AdamW, random weights. Dev tool:

    PYTHONPATH=src python3 bench/profile_train_llama.py"""
import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import transfuse

torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
cfg._attn_implementation = "sdpa"
model = transformers.LlamaForCausalLM(cfg).cuda().train()
model.loss_type = "ForCausalLM"
transfuse.optimize(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 32000, (4, 1024), device="cuda")
def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward(); opt.step()
for _ in range(3): step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3): step()
    torch.cuda.synchronize()
print(f"kernel time per step {sum(e.self_device_time_total for e in prof.key_averages()) / 3e3:.2f} ms")
ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
ev[0].record()
for _ in range(5): step()
ev[1].record(); torch.cuda.synchronize()
print(f"wall per step {ev[0].elapsed_time(ev[1]) / 5:.2f} ms")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
