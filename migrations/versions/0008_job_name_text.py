"""jobs.name: text, not varchar(200).

A study's jobs are named `<study>/<variant>[/seed<N>]`, each part up to 200 characters: on
PostgreSQL a study whose names added up to more than 200 failed to store (a 500).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.alter_column('name', type_=sa.Text(), existing_type=sa.String(length=200),
                              existing_nullable=False)


def downgrade() -> None:
    # Names over 200 characters are cut to fit the older column.
    op.execute(sa.text("UPDATE jobs SET name = substr(name, 1, 200) WHERE length(name) > 200"))
    with op.batch_alter_table('jobs') as batch_op:
        batch_op.alter_column('name', type_=sa.String(length=200), existing_type=sa.Text(),
                              existing_nullable=False)
