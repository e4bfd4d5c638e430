"""Text the callbacks and the report write: one way to make each kind of it.

- :mod:`.markdown`: markdown pipe tables (the diagnoses, the advice tables, the report);
- :mod:`.terminal`: those tables as aligned plain text for a terminal (``trainvitals demo``, the report's text);
- :mod:`.prose`: names, counts and shares in a message's words (the first few names, a noun with its plural, a
  percent);
- :mod:`.intervals`: an estimate with its 90 % interval (the band ratio), the point never outside it.
"""
