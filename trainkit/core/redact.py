"""Credentials kept out of what trainkit prints and logs: the user-info of URLs and token-like
query parameters, in any message that may quote a URL (a tracking server's, a bucket's).

>>> redacted("MLflow at 'http://alice:s3cr3t@host:5000/' failed")
"MLflow at 'http://alice:***@host:5000/' failed"
>>> redacted("GET https://host/api?run=3&access_token=abc123&x=1 -> 401")
'GET https://host/api?run=3&access_token=***&x=1 -> 401'
>>> redacted("s3://token@bucket/runs")
's3://***@bucket/runs'
"""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^/@\s:'\"]*)(?P<password>:[^/@\s'\"]*)?@")
_TOKEN = re.compile(
    r"(?P<name>[?&;](?:access_token|token|api_key|apikey|key|secret|password|passwd|sig|signature|auth|"
    r"credential|x-amz-signature|x-amz-credential|x-amz-security-token)=)[^&\s'\"#]+",
    re.IGNORECASE,
)


def redacted(text: str) -> str:
    """``text`` with URL passwords (``user:***@``), bare user-info tokens (``***@``) and
    token-like query values (``token=***``) masked."""

    def userinfo(match: re.Match) -> str:
        if match["password"]:
            return f"{match['scheme']}{match['user']}:***@"
        return f"{match['scheme']}***@"

    return _TOKEN.sub(lambda m: f"{m['name']}***", _USERINFO.sub(userinfo, text))
