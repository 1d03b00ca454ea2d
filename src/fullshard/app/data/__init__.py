"""Text in (layer 11): corpora, tokenizers, the batch samplers, prepared token shards and their
checks."""
