"""OpenAI's Realtime API over WebSocket (``/v1/realtime``)."""
