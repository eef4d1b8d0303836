from backends.placeholder.expand import count_placeholders, expand_placeholders, placeholder_spans

__all__ = ["count_placeholders", "expand_placeholders", "placeholder_spans"]
