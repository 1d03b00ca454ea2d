"""transformers' Trainer with FSDP2, fullshard in the place of torch's ``fully_shard`` (README:
"accelerate and transformers' Trainer").

    torchrun --nproc-per-node 2 examples/trainer_fsdp2.py

(the Trainer turns FSDP on for accelerators; a tiny Llama is built locally, nothing is
downloaded.)
"""

import fullshard

fullshard.install()  # first: torch.distributed.fsdp.fully_shard is fullshard's from here on

import tempfile  # noqa: E402

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402


def main() -> list[float]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 64, (12,), generator=g) for _ in range(8)]
    data = [{"input_ids": t, "labels": t} for t in rows]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=2,
            learning_rate=1e-2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            fsdp="full_shard",
            fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
    assert isinstance(trainer.model, fullshard.FSDPModule)  # sharded by fullshard
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


if __name__ == "__main__":
    main()
