"""tokens.revoked_at: `csx token revoke` ends a token without deleting its row.

A token died only when its row was deleted by hand, leaving its jobs pointing at no owner (an
admin's job listing answered 500). A revoked token keeps its row and its jobs their owner;
its secret no longer authenticates.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tokens') as batch_op:
        batch_op.add_column(sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('tokens') as batch_op:
        batch_op.drop_column('revoked_at')
