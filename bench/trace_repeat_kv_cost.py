"""What Hugging Face's repeat_kv costs Dynamo's trace of a grouped-query decoder (a lead, not used).

With an attention mask, transformers' SDPA integration repeats each KV head for its query group
(`x[:, :, None].expand(...).reshape(...)`) instead of passing enable_gqa (`use_gqa_in_sdpa` says no
to a mask). transfuse's GroupedKV pass removes the repeat from the graph, but the trace has paid for
its fake-tensor work first: a reshape of an expanded tensor with symbolic sizes. `--gqa` makes
use_gqa_in_sdpa ignore the mask in this process, so the trace never sees the repeat (SDPA with
enable_gqa, which transfuse's attention takes as it is). Prints Dynamo's compile and fake-tensor
seconds for the prompt's and the decode step's traces of a generate() call, and whether its tokens
equal eager's.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/trace_repeat_kv_cost.py [--gqa] [--layers 8]
"""

import argparse

import torch
import transformers
import transformers.integrations.sdpa_attention as sdpa_integration

import transfuse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gqa", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    cli = parser.parse_args()
    if cli.gqa:
        sdpa_integration.use_gqa_in_sdpa = lambda attention_mask, key, value: key.shape[-1] == value.shape[-1] <= 256
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=cli.layers, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=97,
                                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.LlamaForCausalLM(config).eval().to(cli.device)
    ids = torch.randint(3, 97, (2, 6), device=cli.device)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        transfuse.optimize(model)
        out = model.generate(ids, **kwargs)
    names, values = torch._dynamo.utils.compile_times(repr="csv")
    seconds = dict(zip(names, values))
    print(f"{'enable_gqa' if cli.gqa else 'repeat_kv'}: tokens equal eager's {torch.equal(out, ref)}; "
          f"compile_inner {seconds.get('_compile.compile_inner')} s; get_fake_value {seconds.get('get_fake_value')} s")


if __name__ == "__main__":
    main()
