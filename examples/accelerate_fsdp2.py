"""accelerate's FSDP2 with fullshard in the place of torch's ``fully_shard`` (README: "accelerate
and transformers' Trainer").

    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 examples/accelerate_fsdp2.py

(accelerate turns FSDP on for accelerators; a tiny Llama is built locally, nothing is
downloaded.)
"""

import fullshard

fullshard.install()  # first: torch.distributed.fsdp.fully_shard is fullshard's from here on

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def main() -> list[float]:
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        cpu_ram_efficient_loading=True,  # rank 0's weights, loaded into meta shards
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, fullshard.FSDPModule)  # sharded by fullshard
    losses = []
    g = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 12), generator=g).to(accelerator.device)
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    accelerator.print(f"losses {losses}")
    return losses


if __name__ == "__main__":
    main()
