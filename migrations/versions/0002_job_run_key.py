"""jobs.run_key: a random key in each job's folder name, so folders never collide.

A database recreated over an old runs folder numbers its jobs from 1 again; with the id alone
in the folder name, a new job 1 resumed from the old job 1's checkpoint and appended to its
log. Jobs from before this revision keep run_key NULL and their old folder, job-<id>.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.add_column(sa.Column('run_key', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.drop_column('run_key')
