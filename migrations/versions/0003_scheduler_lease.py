"""scheduler_lease: one server schedules a database's jobs at a time.

Two `csx serve` on one database each took the other's RUNNING jobs for orphans and ran them
again, into the same model folder. The lease row names the server that schedules.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'scheduler_lease',
        sa.Column('name', sa.String(length=50), nullable=False),
        sa.Column('holder', sa.String(length=200), nullable=False),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint('name'),
    )


def downgrade() -> None:
    op.drop_table('scheduler_lease')
