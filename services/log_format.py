"""`--log-format json`: one JSON object per log record, for log shippers.

Keys: `ts` (UTC, ISO 8601 with milliseconds), `level`, `logger`, `message`, and `exception`
(the formatted traceback) when the record carries one. The message is the same text the
`text` format prints, so what the log-hygiene rules keep out of messages stays out here too.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)
