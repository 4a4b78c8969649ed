"""Dev tool: Hugging Face Llama (8 layers, 1.1B width) training step, batch 4 x 1024, bf16 autocast, fused AdamW: torch.compile
(default, sdpa) vs transfuse vs eager, one process, CUDA events, median of 10 after 3 warm-up steps.

    PYTHONPATH=src python3 bench/train_llama_vs_compile.py eager,transfuse,compile"""
import copy, statistics, sys, torch, transformers, transfuse
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)
cfg._attn_implementation = "sdpa"
base = transformers.LlamaForCausalLM(cfg).cuda().train()
base.loss_type = "ForCausalLM"
x = torch.randint(0, 32000, (4, 1024), device="cuda")
for name in sys.argv[1].split(","):
    model = copy.deepcopy(base)
    run = torch.compile(model) if name == "compile" else transfuse.optimize(model) if name == "transfuse" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(input_ids=x, labels=x).loss
        loss.backward(); opt.step()
        return loss
    for _ in range(3): loss = step()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); loss = step(); b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b))
    print(f"{name}: {statistics.median(times):.2f} ms/step, loss {loss.item():.4f}, peak {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB reserved", flush=True)
    del model, run, opt; torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
