"""The double's own machinery: call recording, number formats and layout inverses.

Nothing here exists in the real aiter; the leading underscore keeps it out of the API drift check.
"""
