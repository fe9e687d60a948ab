"""Adapters that plug hicache into inference engines (SGLang, vLLM) through their own
extension points. Each adapter imports its engine; nothing in hicache imports an adapter."""
