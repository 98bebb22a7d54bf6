"""Drives a whole session through a client generated from /openapi.json.

    python drive_session.py CLIENT_PARENT_DIR BASE_URL TOKEN

CLIENT_PARENT_DIR holds the package `dexa_client` that openapi-python-client
generated. Every answer must come back as the generated model the document
names (not a dict), with its fields typed; any other answer fails the run.
The server plays the `Helpdesk` script of tests/tests/api_client.rs: turn 1
asks for an approval, turn 2 answers at once.
"""

import json
import sys
import time

import httpx

sys.path.insert(0, sys.argv[1])
BASE_URL, TOKEN = sys.argv[2], sys.argv[3]

import dexa_client.models  # noqa: E402
from dexa_client import AuthenticatedClient  # noqa: E402
from dexa_client.api.default import (  # noqa: E402
    get_agent_snapshot,
    get_step_history,
    list_agent_messages,
    list_agents,
    list_sessions,
    resolve_interrupt,
    send_user_message,
    start_session,
    stop_session,
)
from dexa_client.models import (  # noqa: E402
    AgentInterrupt,
    AgentList,
    AgentMessage,
    AgentMessagesPage,
    AgentSnapshot,
    AgentState,
    AgentUsage,
    Error,
    ErrorCode,
    FlowStatus,
    Queued,
    WaitStatus,
    ResolveInterrupt,
    Resolved,
    SendMessage,
    SessionList,
    SessionStarted,
    SessionStatus,
    SessionSummary,
    StartSession,
    StepHistory,
    StepHistoryEntry,
    Stopped,
)


def expect(value, kind, what):
    if not isinstance(value, kind):
        raise AssertionError(f"{what}: expected {kind.__name__}, got {type(value).__name__}: {value!r}")
    return value


def snapshot_until(client, session, accept, what):
    for _ in range(1500):
        snapshot = expect(get_agent_snapshot.sync(session_id=session, client=client), AgentSnapshot, "snapshot")
        if accept(snapshot):
            return snapshot
        time.sleep(0.02)
    raise AssertionError(f"session {session} never reached: {what}")


client = AuthenticatedClient(base_url=BASE_URL, token=TOKEN, raise_on_unexpected_status=True)
with client:
    agents = expect(list_agents.sync(client=client), AgentList, "agents")
    assert [agent.name for agent in agents.agents] == ["Helpdesk"], agents

    started = start_session.sync(agent="Helpdesk", client=client, body=StartSession(session_id="py-1", message="pay"))
    expect(started, SessionStarted, "start")
    assert (started.session_id, started.agent) == ("py-1", "Helpdesk")

    snapshot = snapshot_until(client, "py-1", lambda s: len(s.pending_interrupts) > 0, "a pending approval")
    assert snapshot.flow_status == FlowStatus.RUNNING
    interrupt = expect(snapshot.pending_interrupts[0], AgentInterrupt, "interrupt")
    assert interrupt.interrupt_id == "turn-1/pay", interrupt
    state = expect(snapshot.state, AgentState, "state")
    assert state.status == SessionStatus.RUNNING_TOOLS, state
    expect(snapshot.usage, AgentUsage, "usage")

    # An interrupt the session never raised: a typed 404.
    unknown = resolve_interrupt.sync_detailed(
        session_id="py-1", client=client, body=ResolveInterrupt(interrupt_id="turn-1/nope", approved=True)
    )
    assert unknown.status_code == 404, unknown
    error = expect(unknown.parsed, Error, "404")
    assert error.error.code == ErrorCode.INTERRUPT_NOT_FOUND, error

    resolved = resolve_interrupt.sync(
        session_id="py-1", client=client, body=ResolveInterrupt(interrupt_id=interrupt.interrupt_id, approved=True)
    )
    assert expect(resolved, Resolved, "resolve").resolved is True

    snapshot = snapshot_until(
        client, "py-1", lambda s: s.state is not None and s.state.turn_count == 1 and s.state.active_turn_id is None,
        "turn 1 to end",
    )
    # Turn 2, waited for: the answer carries the turn's messages and usage.
    queued = send_user_message.sync(session_id="py-1", client=client, body=SendMessage(text="again"), wait=60.0)
    expect(queued, Queued, "send")
    assert queued.status == WaitStatus.COMPLETED, queued
    assert [expect(m, AgentMessage, "message").text for m in queued.messages] == ["hello again"], queued
    expect(queued.usage, AgentUsage, "turn usage")

    page = expect(list_agent_messages.sync(session_id="py-1", client=client, limit=2), AgentMessagesPage, "messages")
    assert [m.sequence for m in page.messages] == [1, 2], page
    assert page.next_after_sequence == 2, page

    history = expect(get_step_history.sync(session_id="py-1", client=client), StepHistory, "history")
    steps = [expect(s, StepHistoryEntry, "step").step_type for s in history.steps]
    assert "AwaitToolApproval" in steps and "RunModel" in steps, steps

    # The event stream, each event's data read into the generated model its
    # type names (`turn_started` is TurnStartedEvent, with TurnStartedData).
    seen = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.stream("GET", f"{BASE_URL}/v1/sessions/py-1/events", headers=headers, timeout=30) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data:"):
                continue
            data = json.loads(line[len("data:"):].strip())
            kind = "".join(word.capitalize() for word in data["type"].split("_"))
            event_model = getattr(dexa_client.models, f"{kind}Event")
            data_model = getattr(dexa_client.models, f"{kind}Data")
            event = expect(event_model.from_dict(data), event_model, data["type"])
            expect(event.data, data_model, f"{data['type']} data")
            if data["type"] == "usage_recorded":
                expect(event.data.recorded, AgentUsage, "recorded usage")
            seen.append(data["type"])
            if seen.count("turn_completed") == 2:
                break
    for kind in ("turn_started", "tool_call_deferred", "interrupt_raised", "interrupt_resolved", "usage_recorded"):
        assert kind in seen, (kind, seen)

    sessions = expect(list_sessions.sync(client=client, agent="Helpdesk"), SessionList, "sessions")
    summary = expect(sessions.sessions[0], SessionSummary, "summary")
    assert (summary.session_id, summary.status) == ("py-1", FlowStatus.RUNNING), summary

    stopped = expect(stop_session.sync(session_id="py-1", client=client), Stopped, "stop")
    assert stopped.stopped is True
    snapshot = expect(get_agent_snapshot.sync(session_id="py-1", client=client), AgentSnapshot, "snapshot")
    assert snapshot.flow_status == FlowStatus.STOPPED

print("a whole session through the generated client: ok")
