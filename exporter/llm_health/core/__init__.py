"""The decision core: parsing engine payloads, telling busy from hung, the age-first
admission policy and the restart policy. Pure: no I/O, no clock (time is passed in), and
no aiohttp or redis import (tests/unit/test_structure.py enforces it)."""
