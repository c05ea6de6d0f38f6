"""User data as samples: dataset files, their order, tokenizers, and the built-in tasks."""
