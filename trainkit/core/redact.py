"""Credentials kept out of what trainkit prints and logs: the user-info of URLs and token-like
query parameters, in any message that may quote a URL (a tracking server's, a bucket's).

>>> redacted("MLflow at 'http://alice:s3cr3t@host:5000/' failed")
"MLflow at 'http://alice:***@host:5000/' failed"
>>> redacted("GET https://host/api?run=3&access_token=abc123&x=1 -> 401")
'GET https://host/api?run=3&access_token=***&x=1 -> 401'
>>> redacted("s3://token@bucket/runs")
's3://***@bucket/runs'
>>> redacted("http://alice:p@ss@host:5000/ private_token=abc Authorization: Bearer eyJ.x")
'http://alice:***@host:5000/ private_token=*** Authorization: Bearer ***'
>>> redacted("s3:/alice:s3cr3t@bucket/run https://hooks.slack.com/services/T0001/B0002/XXXXsecret")
's3:/alice:***@bucket/run https://hooks.slack.com/services/***'

Tokens that are credentials by their form alone, wherever they stand (GitHub's, Hugging Face's, Slack's,
AWS access key ids, a Telegram bot's):

>>> redacted("push with ghp_0123456789abcdefghijABCDEFGHIJ012345")
'push with ***'
>>> redacted("https://api.telegram.org/bot123456789:AAH-abcdefghijklmnopqrstuvwxyz0123456/sendMessage")
'https://api.telegram.org/bot***/sendMessage'
"""

from __future__ import annotations

import re

#: a URL's user-info runs to the authority's last ``@`` (a raw ``@`` in a password, as URL parsers read it)
_USERINFO = re.compile(
    r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*:/{1,2})(?P<user>[^/@\s:'\"?#]*)(?P<password>:[^/\s'\"?#]*)?@"
)  # one slash too: pathlib.Path collapses a URL's "//"
_TOKEN = re.compile(
    r"(?P<name>\b(?:access_token|token|private_token|refresh_token|id_token|session_token|client_secret|api_key|"
    r"apikey|key|secret|password|passwd|sig|signature|auth|credential|x-amz-signature|x-amz-credential|"
    r"x-amz-security-token)=)[^&\s'\"#]+",
    re.IGNORECASE,
)
#: an HTTP authorization header's credentials, or a bearer token quoted alone
_AUTHORIZATION = re.compile(
    r"(?P<name>\bauthorization:\s*(?:bearer|basic|token)\s+|\bbearer\s+)[^\s'\"]+", re.IGNORECASE
)
#: an environment variable's credential (``HF_TOKEN=...``, ``AWS_SECRET_ACCESS_KEY=...``)
_ENVIRONMENT = re.compile(
    r"(?P<name>\b[A-Z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|APIKEY|ACCESS_KEY|PRIVATE_KEY|CREDENTIALS?)"
    r"[A-Z0-9_]*=)[^\s'\"&]+"
)
#: a JSON field holding a credential (``"password": "..."``)
_JSON_FIELD = re.compile(
    r"(?P<name>\"(?:password|passwd|secret|token|access_token|refresh_token|client_secret|api_key|apikey|auth)\"\s*:\s*)"
    r"\"[^\"]*\"",
    re.IGNORECASE,
)
#: a command-line option's credential (``--token x``, ``--password=x``)
_OPTION = re.compile(
    r"(?P<name>--(?:[a-z0-9]+[-_])*(?:token|password|passwd|secret|api[-_]key|apikey)(?:=|\s+))[^\s'\"]+", re.IGNORECASE
)
#: a header whose whole value is a credential (``X-API-Key: ...``, ``Cookie: a=1; b=2``)
_HEADER = re.compile(
    r"(?P<name>\b(?:x-api-key|api-key|x-auth-token|cookie|set-cookie|proxy-authorization)\s*:\s*)[^\n'\"}]+",
    re.IGNORECASE,
)


#: a webhook whose path is its credential (Slack's, Discord's, Teams')
_WEBHOOK = re.compile(
    r"(?P<name>\bhttps?://(?:hooks\.slack\.com/(?:services|workflows|triggers)|(?:[a-z0-9-]+\.)?discord(?:app)?\.com/"
    r"api/webhooks|[a-z0-9-]+\.webhook\.office\.com/webhookb2)/)[^\s'\"]+",
    re.IGNORECASE,
)


#: a credential recognisable by its form alone
_BARE = re.compile(
    r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{20,}|hf_[A-Za-z0-9]{30,}|"
    r"xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})(?![A-Za-z0-9_-])"
    r"|(?:(?<![A-Za-z0-9_])|(?<=bot))\d{6,12}:[A-Za-z0-9_-]{30,}"  # a Telegram bot's, alone or in its API's URL
)


def redacted(text: str) -> str:
    """``text`` with URL passwords (``user:***@``), bare user-info tokens (``***@``),
    token-like values (``token=***``, ``client_secret=***``), authorization credentials
    (``Authorization: Bearer ***``), environment variables (``HF_TOKEN=***``), JSON fields
    (``"password": "***"``), command-line options (``--token ***``) and credential headers
    (``X-API-Key: ***``, ``Cookie: ***``) masked, and tokens credentials by their form (``ghp_...``)."""

    def userinfo(match: re.Match[str]) -> str:
        if match["password"]:
            return f"{match['scheme']}{match['user']}:***@"
        return f"{match['scheme']}***@"

    masked = _TOKEN.sub(lambda m: f"{m['name']}***", _USERINFO.sub(userinfo, text))
    masked = _JSON_FIELD.sub(lambda m: f'{m["name"]}"***"', masked)
    for pattern in (_AUTHORIZATION, _ENVIRONMENT, _OPTION, _HEADER, _WEBHOOK):
        masked = pattern.sub(lambda m: f"{m['name']}***", masked)
    return _BARE.sub("***", masked)
