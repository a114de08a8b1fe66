"""Text: tokenizer and chat templates, incremental detokenizer, stop strings."""
