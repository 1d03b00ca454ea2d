"""The models trained and how they are sharded (layer 11): the built-in GPT, Hugging Face
models, the sharding plan applied to a model, tensor parallel."""
