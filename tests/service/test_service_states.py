"""The transition table and states.move: legal moves write events, illegal ones raise."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service import crud
from service.db import make_engine, make_sessionmaker, upgrade_database
from service.models import Job, JobEvent
from service.states import TERMINAL, TRANSITIONS, IllegalTransition, JobStatus, move

S = JobStatus


def test_table_covers_every_state_and_terminals_are_closed() -> None:
    assert set(TRANSITIONS) == set(JobStatus)
    assert TRANSITIONS[S.SUCCEEDED] == TRANSITIONS[S.CANCELLED] == frozenset()
    assert TRANSITIONS[S.FAILED] == {S.QUEUED}  # only the explicit retry
    assert TRANSITIONS[S.CANCELLING] == {S.CANCELLED}
    assert {S.RECOVERING} <= TRANSITIONS[S.RUNNING] and {S.RUNNING} <= TRANSITIONS[S.RECOVERING]
    assert TERMINAL == {S.SUCCEEDED, S.FAILED, S.CANCELLED}


@pytest.fixture
def sessions(service_settings) -> Iterator[sessionmaker[Session]]:
    """The service's database without its scheduler: these tests move jobs by hand, and a
    running scheduler would pick up the same QUEUED jobs and move them concurrently."""
    upgrade_database(service_settings.database_url)
    engine = make_engine(service_settings.database_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def _new_job(sessions: sessionmaker[Session]) -> tuple[Session, Job]:
    session = sessions()
    _, secret = crud.create_token(session, name="t")
    owner = crud.get_caller(session, secret=secret)
    row = crud.add_job(session, owner=owner, name="j", experiment="e", mode="train", num_csx=1,
                       priority=0, max_failures=0, timeout_s=None, tags={}, params={})
    session.commit()
    return session, session.get(Job, row["id"])


def test_move_along_the_happy_path_writes_one_event_each(sessions: sessionmaker[Session]) -> None:
    session, job = _new_job(sessions)
    path = [S.VALIDATING, S.PROVISIONING, S.RUNNING, S.RECOVERING, S.RUNNING, S.SUCCEEDED]
    for target in path:
        move(session, job, target, message=f"to {target}")
        session.commit()
    events = session.query(JobEvent).filter_by(job_id=job.id).order_by(JobEvent.id).all()
    assert [e.to_status for e in events] == ["QUEUED", *path]
    assert [e.from_status for e in events[1:]] == ["QUEUED", *path[:-1]]
    assert job.started_at is not None and job.finished_at >= job.started_at
    with pytest.raises(IllegalTransition, match="from SUCCEEDED to RUNNING; allowed from "
                                                "SUCCEEDED: none"):
        move(session, job, S.RUNNING)
    session.close()


@pytest.mark.parametrize(("path", "illegal"), [
    ([], S.RUNNING),
    ([], S.SUCCEEDED),
    ([S.VALIDATING, S.PROVISIONING, S.RUNNING, S.CANCELLING], S.SUCCEEDED),
    ([S.CANCELLED], S.QUEUED),
    ([S.VALIDATING, S.FAILED], S.RUNNING),
])
def test_illegal_moves_raise_and_change_nothing(sessions: sessionmaker[Session], path: list[JobStatus],
                                                illegal: JobStatus) -> None:
    session, job = _new_job(sessions)
    for target in path:
        move(session, job, target)
    session.commit()
    before = (job.status, session.query(JobEvent).count())
    with pytest.raises(IllegalTransition):
        move(session, job, illegal)
    assert (job.status, session.query(JobEvent).count()) == before
    session.close()


def test_retry_starts_a_new_attempt(sessions: sessionmaker[Session]) -> None:
    session, job = _new_job(sessions)
    for target in (S.VALIDATING, S.PROVISIONING, S.RUNNING, S.FAILED):
        move(session, job, target, message="boom" if target is S.FAILED else None)
    assert (job.status_message, job.finished_at is not None) == ("boom", True)
    move(session, job, S.QUEUED, message="retry")
    session.commit()
    assert (job.attempt, job.finished_at, job.started_at, job.systems) == (2, None, None, [])
    last = session.query(JobEvent).order_by(JobEvent.id.desc()).first()
    assert (last.from_status, last.to_status, last.attempt) == ("FAILED", "QUEUED", 2)
    session.close()
