"""Conversations and a tokenizer: the chat tokens (tokens.py), rendering with a template
(template.py, Jinja templates in jinja.py). Packing them into windows: data/packing/chat.py."""
