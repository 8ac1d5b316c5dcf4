"""`llm-health gate`: the age-first admission gate, a reverse proxy (`app`) reading its
inputs from request headers (`headers`) and the Redis queue."""
