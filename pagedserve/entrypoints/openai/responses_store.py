"""Responses kept in the server's memory (a request's store: true, the API's default), for GET /v1/responses/{id}, its
input items, and a later request's previous_response_id: each with the items that went into it and the conversation up
to it, as chat messages. The oldest go
first past the server's limit (--max-stored-responses), so memory stays bounded however long the server runs."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.entrypoints.openai.event_log import EventLog
from pagedserve.entrypoints.openai.responses_protocol import ListedItem, ResponseObject


@dataclass
class StoredResponse:
    response: ResponseObject
    # What went into it, in order: the earlier turns' input and output items (by previous_response_id), then its own
    # request's input.
    input_items: list[ListedItem]
    # Every turn's messages up to and including this response's own, instructions left out; None while a background
    # response runs.
    conversation: list[dict] | None
    # A streamed background response's events, for clients that read its stream again; None for other responses.
    events: EventLog | None = None


class ResponseStore:
    def __init__(self, max_responses: int) -> None:
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, input_items: list[ListedItem], conversation: list[dict] | None,
            events: EventLog | None = None) -> None:
        """A new response goes in last; a background response, put again once done, keeps its place and its events."""
        stored = self._responses.get(response.id)
        if stored is not None:
            stored.response, stored.conversation = response, conversation
            return
        self._responses[response.id] = StoredResponse(response, input_items, conversation, events)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None
