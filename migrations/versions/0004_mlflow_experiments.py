"""mlflow_experiments: the MLflow experiments the service created, per owner and name.

Jobs looked their experiment up by name (`<user>/<experiment>`), and with MLflow's basic-auth
app whoever creates an experiment manages it: a user who created another user's experiment
name first received that user's runs and could read and delete them. Jobs now log only into
experiments recorded here (service/experiments.py). Nothing is carried over from jobs logged
before: an experiment this table does not hold may have been created by anyone.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-28
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        'mlflow_experiments',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('owner_id', sa.Integer(), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('mlflow_name', sa.String(length=256), nullable=False),
        sa.Column('mlflow_experiment_id', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['owner_id'], ['tokens.id'], ),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('owner_id', 'name', name='uq_mlflow_experiment_owner_name'),
    )


def downgrade() -> None:
    op.drop_table('mlflow_experiments')
